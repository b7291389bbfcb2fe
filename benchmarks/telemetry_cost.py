"""Between gates, measured: what the training-batch telemetry costs a training step, what it writes and what it logs.

``python benchmarks/telemetry_cost.py`` writes ``benchmarks/telemetry_cost.json`` (section (o) of
``benchmarks/RESULTS.md``). One process, one torch thread (as the demo), on the demo's shape unless said: the demo
model (``build_qwen3_moe()``: width 64, 4 routed layers x 32 experts, top-2, byte vocabulary) trained on 16 x 128-token
prose windows with AdamW.

- ``steps``: a plain training loop (forward, backward, AdamW step), steps with the telemetry (the counting hooks
  attached, ``AtlasGate.step`` after the step) interleaved one by one with steps without it (hooks detached, a
  telemetry-disabled gate's ``step``), on the same model and the same batches, in the order on/off, off/on, ...
  Each step is timed in CPU seconds (``time.process_time``: the machine is shared) and wall seconds. Every 50 steps
  with the telemetry close one interval (collect, alarm, summary, ``load.jsonl``: the default cadence), so the
  overhead per interval, (sum of its 50 steps with / sum of the 50 steps beside them without) - 1, has the close
  amortised; its median and spread over ``--pairs`` intervals, and the median over single step pairs (which leaves
  the close out).
- ``parts``: what the per-step figure is made of, each timed on its own: the counting hooks' bodies, timed inside
  training passes (forward and backward) and called directly on one forward's router outputs ``--calls`` times;
  a training forward and backward without and with the counting hooks, interleaved; ``AtlasGate.step`` at a step
  that closes nothing.
- ``close``: one interval close (``AtlasGate.step`` at a step that ends an interval), and its parts (the counter's
  collect, the tracker summary ``load_metrics``, ``append_load``: the line appended to ``load.jsonl``, one write
  and an fsync, the delivery's copy), at the demo's shape and at the DeepSeek-V3 layout (58 routed layers x 256
  experts, k = 8, on a width-16 model whose counters are given a realistic interval's counts).
- ``fit``: a Lightning fit of the demo's recipe (``MoELM``, ``log_every_n_steps`` 50) with ``AtlasCallback``, no gate
  at all (``gate.baseline_at_start`` false, no validation), ``telemetry.enabled`` true against false, fits
  alternated; timed from the end of ``on_train_start`` to ``on_train_end`` (the training loop only).
- ``bytes``: the ``load.jsonl`` line of one interval at the DeepSeek-V3 layout as the code writes it (the real close
  above, its counts those of 50 steps at a stated global batch), per 1,000 steps at one interval per 50 steps
  (Lightning's default ``log_every_n_steps``, the plain loop's default): extrapolated from one line. With expert
  parallelism each layer's row also holds ``ep_ranks`` and ``ep_tokens``, one integer each per process that holds
  the layer's experts: that line is the written one with both added as ``RouteCounter.collect`` makes them, for
  DeepSeek-V3's 2,048 GPUs (16 pipeline stages x 128 data-parallel ranks, expert-parallel groups of 64: a layer's
  experts are held by the 128 processes of its stage).
- ``keys``: the tracker keys of one interval at that layout (``load_metrics`` with the default ``top_experts``), and
  those a real offline W&B run receives through ``WandbSink.log_load`` on an ordinary and on a picture interval
  (read back from its files), against one key per expert per layer.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atlas_tracking import AtlasConfig, Canary
from atlas_tracking.artifacts.history import append_line
from atlas_tracking.artifacts.load_summary import load_metrics
from atlas_tracking.engine.route_counts import RouteCounter
from atlas_tracking.gate import AtlasGate
from atlas_tracking.schema.artifacts import LOAD
from atlas_tracking.testing.bench import write_result
from atlas_tracking.testing.demo import demo_canary
from atlas_tracking.testing.demo_data import encode, prose_text
from atlas_tracking.testing.lightning_lm import MoELM, build_qwen3_moe

HERE = Path(__file__).resolve().parent
EVERY = 50
"""Optimizer steps per interval: Lightning's default ``log_every_n_steps`` and the plain loop's default."""
BATCH, WINDOW = 16, 128
QUIET: dict[str, Any] = {"receipts": {"progress": False}, "gate": {"baseline_at_start": False}}

DSV3 = {"routed_layers": 58, "experts": 256, "top_k": 8, "world": 2048, "pipeline_stages": 16, "expert_parallel": 64}
"""DeepSeek-V3's layout and its training's parallelism (2,048 GPUs: 16 pipeline stages, 64-way expert parallelism,
data parallelism over the rest)."""
GLOBAL_BATCHES = {"deepseek_v3_15360x4096": 15_360 * 4096, "4m_tokens": 4 * 2**20}
"""Tokens per optimizer step: DeepSeek-V3's batch after its ramp (15,360 sequences of 4,096 tokens), and 4M."""
NAIVE = {"36 x 256": 36 * 256, "58 x 256 (DeepSeek-V3)": 58 * 256}
"""One tracker key per expert per routed layer."""


def clocks() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles and extremes of a list."""
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": min(values), "max": max(values)}


def demo_batches(count: int, seed: int = 0) -> list[torch.Tensor]:
    """``count`` training batches of the demo's shape from the prose stream."""
    prose = encode(prose_text())
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(prose) - WINDOW, size=(count, BATCH))
    return [torch.from_numpy(np.stack([prose[s:s + WINDOW] for s in row]).astype(np.int64)) for row in starts]


def small_canary() -> Canary:
    """A gate never runs here; the gate needs a canary all the same."""
    return Canary.from_token_ids(demo_canary().windows.reshape(-1), window=WINDOW, n_windows=4, seed=0)


def gates(model: torch.nn.Module, out: Path) -> tuple[AtlasGate, AtlasGate]:
    """A gate with the telemetry at every ``EVERY`` steps and one with it disabled, on the same model."""
    on = AtlasGate(model, small_canary(), {**QUIET, "telemetry": {"every_n_steps": EVERY}}, out_dir=str(out / "on"))
    off = AtlasGate(model, small_canary(), {**QUIET, "telemetry": {"enabled": False}}, out_dir=str(out / "off"))
    return on, off


# --- (1) the training step ---------------------------------------------------------------------------------
def training_steps(pairs: int, out: Path) -> dict[str, Any]:
    """``pairs`` intervals of ``EVERY`` training steps with the telemetry, each step interleaved with one without it
    (see the module docstring)."""
    torch.manual_seed(0)
    module = MoELM(build_qwen3_moe(seed=0))
    model, optimizer = module.model.train(), module.configure_optimizers()
    batches = demo_batches(EVERY)
    on, off = gates(model, out)
    counter = on.telemetry.counter
    stepped = {"on": 0, "off": 0}

    def step(label: str, ids: torch.Tensor) -> tuple[float, float]:
        gate = on if label == "on" else off
        (counter.attach if label == "on" else counter.detach)()
        c0, w0 = clocks()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stepped[label] += 1
        gate.step(stepped[label])
        c1, w1 = clocks()
        return c1 - c0, w1 - w0

    def interval() -> dict[str, dict[str, list[float]]]:
        """One interval's steps with the telemetry and as many without, in the order on/off, off/on, ..."""
        t: dict[str, dict[str, list[float]]] = {"cpu": {"on": [], "off": []}, "wall": {"on": [], "off": []}}
        for j, ids in enumerate(batches):
            for label in (("on", "off") if j % 2 == 0 else ("off", "on")):
                cpu, wall = step(label, ids)
                t["cpu"][label].append(cpu)
                t["wall"][label].append(wall)
        return t

    interval()  # warm-up
    blocks = [interval() for _ in range(pairs)]
    counter.attach()
    lines = (out / "on" / LOAD).read_text().splitlines()
    result: dict[str, Any] = {"intervals": pairs, "steps_per_interval": EVERY, "intervals_written": len(lines),
                              "routes_per_step_per_layer": BATCH * WINDOW * 2}
    for clock in ("cpu", "wall"):
        on_s = [sum(b[clock]["on"]) for b in blocks]
        off_s = [sum(b[clock]["off"]) for b in blocks]
        steps = [(a, b) for blk in blocks for a, b in zip(blk[clock]["on"], blk[clock]["off"])]
        result[clock] = {
            "step_ms_off": spread([1000 * x / EVERY for x in off_s]),
            "step_ms_on": spread([1000 * x / EVERY for x in on_s]),
            "overhead_per_interval": spread([a / b - 1 for a, b in zip(on_s, off_s)]),
            "overhead_of_totals": sum(on_s) / sum(off_s) - 1,
            "overhead_per_step_pair": spread([a / b - 1 for a, b in steps]),
            "intervals_s": {"on": on_s, "off": off_s},
        }
    return result


# --- (2) its parts -----------------------------------------------------------------------------------------
def timed_inside(counter: RouteCounter, model: torch.nn.Module, ids: torch.Tensor, repeats: int) -> float:
    """CPU milliseconds per training pass spent inside the counting hooks (those ``counter._hook`` makes, each call
    timed), over ``repeats`` forwards and backwards."""
    counter.detach()
    inside = [0.0]
    plain = counter._hook

    def timed(*made: Any) -> Callable[..., None]:
        body = plain(*made)

        def hook(*args: Any) -> None:
            c = time.process_time()
            body(*args)
            inside[0] += time.process_time() - c
        return hook

    counter._hook = timed
    counter.attach()
    for _ in range(repeats):
        model(input_ids=ids, labels=ids).loss.backward()
    counter.detach()
    counter._hook = plain
    return 1000 * inside[0] / repeats


def parts(calls: int, repeats: int, out: Path) -> dict[str, Any]:
    """The counting hooks (called directly, and timed inside training passes), a training forward and backward with
    and without them, and ``AtlasGate.step`` that closes nothing."""
    torch.manual_seed(0)
    model = build_qwen3_moe(seed=0).train()
    ids = demo_batches(1, seed=1)[0]
    on, _ = gates(model, out)
    counter = on.telemetry.counter
    seen: list[tuple[Any, tuple, Any]] = []
    handles = [entry.layer.router.register_forward_hook(
        lambda module, args, output, entry=entry: seen.append((entry, args, output))) for entry in counter._local]
    model(input_ids=ids)
    for handle in handles:
        handle.remove()
    bodies = [(counter._hook(entry), entry.layer.router, args, output) for entry, args, output in seen]
    c0 = time.process_time()
    for _ in range(calls):
        for hook, router, args, output in bodies:
            hook(router, args, {}, output)
    isolated_ms = 1000 * (time.process_time() - c0) / calls
    counter.reset()

    def forward(kind: str) -> float:
        (counter.attach if kind == "on" else counter.detach)()
        c = time.process_time()
        model(input_ids=ids, labels=ids).loss.backward()
        return time.process_time() - c

    kinds = ("off", "on")
    for kind in kinds:
        forward(kind)
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for i in range(repeats):
        for kind in (kinds if i % 2 == 0 else kinds[::-1]):
            times[kind].append(forward(kind))
    counter.reset()
    inside = timed_inside(counter, model, ids, repeats)
    counter.attach()
    model.zero_grad(set_to_none=True)
    on.claim()
    c0 = time.process_time()
    for _ in range(calls):
        on.step(1)  # a step that closes no interval
    step_us = 1e6 * (time.process_time() - c0) / calls
    counter.reset()
    return {
        "hook_bodies_ms_per_forward_in_training": inside,
        "hook_bodies_ms_per_forward_isolated": isolated_ms, "hooked_routers": len(bodies), "calls": calls,
        "forward_backward_ms": {k: spread([1000 * s for s in v]) for k, v in times.items()},
        "forward_backward_overhead_paired": spread([a / b - 1 for a, b in zip(times["on"], times["off"])]),
        "forward_backward_extra_ms_paired": spread([1000 * (a - b) for a, b in zip(times["on"], times["off"])]),
        "gate_step_us_no_close": step_us,
        "pipelining_stage_imported": "torch.distributed.pipelining.stage" in sys.modules,
    }


# --- (3) one interval close --------------------------------------------------------------------------------
def realistic_counts(layers: int, experts: int, top_k: int, tokens: int, seed: int = 0) -> np.ndarray:
    """Per layer and expert, the routes of ``tokens`` tokens at ``top_k``, spread with a trained router's
    imbalance (shares lognormal, sigma 0.3: a load CV near 0.3)."""
    rng = np.random.default_rng(seed)
    shares = rng.lognormal(0.0, 0.3, size=(layers, experts))
    shares /= shares.sum(axis=1, keepdims=True)
    return np.stack([rng.multinomial(tokens * top_k, p) for p in shares]).astype(np.int64)


def fill(gate: AtlasGate, counts: np.ndarray | None, tokens: int, calls: int, model: torch.nn.Module,
         ids: torch.Tensor) -> None:
    """Counts for the next close: ``counts`` put in the counters' place (a realistic interval), or, when None, one
    training forward of ``ids`` (gradients on, as training runs it: a pass without gradients is not counted)."""
    if counts is None:
        model(input_ids=ids)
        return
    for entry, row in zip(gate.telemetry.counter._local, counts):
        entry.chosen = torch.from_numpy(row.copy())
        entry.tokens, entry.calls = tokens, calls


def close_cost(label: str, model: torch.nn.Module, counts: np.ndarray | None, tokens: int, calls: int,
               repeats: int, out: Path) -> dict[str, Any]:
    """One interval close and its parts, ``repeats`` times each (CPU and wall milliseconds)."""
    model.train()
    ids = demo_batches(1, seed=2)[0][:, :32] if counts is None else torch.zeros(1, 8, dtype=torch.long)
    gate, _ = gates(model, out / label)
    gate.claim()
    gate.step(0)
    step = 0
    fill(gate, counts, tokens, calls, model, ids)
    step += EVERY
    gate.step(step)  # the first close agrees the layer table
    file = gate.run_dir.path / LOAD
    line_bytes = file.stat().st_size
    line = json.loads(file.read_text().splitlines()[-1])
    timed: dict[str, list[tuple[float, float]]] = {k: [] for k in
                                                     ("close", "collect", "load_metrics", "append_load", "copy")}
    scratch = out / label / "scratch"

    def timing(name: str, fn: Callable[[], Any]) -> Any:
        c0, w0 = clocks()
        value = fn()
        c1, w1 = clocks()
        timed[name].append((1000 * (c1 - c0), 1000 * (w1 - w0)))
        return value

    for _ in range(repeats):
        fill(gate, counts, tokens, calls, model, ids)
        step += EVERY
        timing("close", lambda s=step: gate.step(s))
        fill(gate, counts, tokens, calls, model, ids)
        timing("collect", gate.telemetry.counter.collect)
        timing("load_metrics", lambda: load_metrics(line, gate.config.telemetry.top_experts))
        timing("append_load", lambda: append_line(scratch / LOAD, line))
        timing("copy", lambda: copy.deepcopy((line, {})))
    return {
        "layers": len(line["layers"]), "experts": len(line["layers"][0]["load"]), "repeats": repeats,
        "line_bytes": line_bytes, "line": line,
        **{f"{name}_ms": {"cpu": spread([c for c, _ in v]), "wall": spread([w for _, w in v])}
           for name, v in timed.items()},
    }


def dsv3_model() -> torch.nn.Module:
    """DeepSeek-V3's routed layout (58 x 256, k = 8) at width 16: the counters and the close are the layout's own."""
    return build_qwen3_moe(seed=0, hidden=16, layers=DSV3["routed_layers"], experts=DSV3["experts"],
                           top_k=DSV3["top_k"], aux_coef=0.0)


# --- (4) a Lightning fit -----------------------------------------------------------------------------------
def lightning_fit(pairs: int, steps: int) -> dict[str, Any]:
    """Fits of ``steps`` steps with ``AtlasCallback``, telemetry on and off, alternated."""
    import lightning.pytorch as pl
    from atlas_tracking.integrations.lightning import AtlasCallback

    from atlas_tracking.testing.lightning_lm import loaders

    warnings.filterwarnings("ignore")
    prose = encode(prose_text())
    train, _ = loaders(prose[:360_000], prose[360_000:400_000], window=WINDOW, batch=BATCH, steps=steps, seed=0)

    class Clock(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.start = clocks()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            end = clocks()
            self.cpu, self.wall = end[0] - self.start[0], end[1] - self.start[1]

    def fit(enabled: bool) -> tuple[float, float, int]:
        pl.seed_everything(0, verbose=False)
        clock = Clock()
        callback = AtlasCallback(small_canary(), {**QUIET, "telemetry": {"enabled": enabled}})
        with tempfile.TemporaryDirectory() as d:
            trainer = pl.Trainer(max_steps=steps, logger=False, default_root_dir=d, callbacks=[callback, clock],
                                 enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                 limit_val_batches=0, accelerator="cpu", devices=1, enable_checkpointing=False,
                                 log_every_n_steps=EVERY)
            trainer.fit(MoELM(build_qwen3_moe(seed=0)), train)
            load = Path(d) / "atlas" / LOAD
            intervals = len(load.read_text().splitlines()) if load.exists() else 0
        assert callback.gate.gates_run == 0
        return clock.cpu, clock.wall, intervals

    fit(True), fit(False)  # warm-up
    times: dict[str, dict[str, list[float]]] = {"cpu": {"on": [], "off": []}, "wall": {"on": [], "off": []}}
    intervals = 0
    for i in range(pairs):
        for label in (("on", "off") if i % 2 == 0 else ("off", "on")):
            cpu, wall, n = fit(label == "on")
            times["cpu"][label].append(cpu)
            times["wall"][label].append(wall)
            intervals = max(intervals, n)
    result: dict[str, Any] = {"pairs": pairs, "steps": steps, "intervals_per_fit_on": intervals}
    for clock, t in times.items():
        result[clock] = {
            "step_ms_off": spread([1000 * s / steps for s in t["off"]]),
            "step_ms_on": spread([1000 * s / steps for s in t["on"]]),
            "overhead_paired": spread([a / b - 1 for a, b in zip(t["on"], t["off"])]),
            "fits_s": t,
        }
    return result


# --- (5) bytes of load.jsonl ---------------------------------------------------------------------------------
def ep_fields(counts: np.ndarray, layer_slot: int, rng: np.random.Generator) -> dict[str, list[int]]:
    """One layer's ``ep_ranks`` and ``ep_tokens`` as ``RouteCounter.collect`` makes them for DeepSeek-V3's
    parallelism: the global ranks that hold the layer's experts (the 128 processes of its pipeline stage, each
    holding 4 of the 256 in its expert-parallel group of 64) and the routes each of them received."""
    world, stages = DSV3["world"], DSV3["pipeline_stages"]
    per_stage = world // stages
    stage = layer_slot * stages // len(counts)
    shares = rng.lognormal(0.0, 0.1, size=per_stage)
    received = rng.multinomial(int(counts[layer_slot].sum()), shares / shares.sum())
    return {"ep_ranks": list(range(stage * per_stage, (stage + 1) * per_stage)),
            "ep_tokens": [int(v) for v in received]}


def line_bytes(line: dict[str, Any], out: Path) -> int:
    """Bytes of ``line`` in ``load.jsonl`` as ``append_line`` writes it."""
    path = out / "line.jsonl"
    path.unlink(missing_ok=True)
    append_line(path, line)
    return path.stat().st_size


def load_bytes(written: dict[str, Any], counts: np.ndarray, out: Path) -> dict[str, Any]:
    """The written line's bytes and with ``ep_ranks`` and ``ep_tokens``, per interval and per 1,000 steps
    (extrapolated)."""
    rng = np.random.default_rng(1)
    with_ep = copy.deepcopy(written["line"])
    for i, row in enumerate(with_ep["layers"]):
        row.update(ep_fields(counts, i, rng))
    intervals = 1000 // EVERY
    plain = line_bytes(written["line"], out)
    ep = line_bytes(with_ep, out)
    load_only = sum(len(json.dumps(row["load"], separators=(",", ":"))) for row in written["line"]["layers"])
    return {"line_bytes": plain, "line_bytes_measured_in_close": written["line_bytes"],
            "load_lists_bytes": load_only, "ep_processes_per_layer": len(with_ep["layers"][0]["ep_ranks"]),
            "line_bytes_with_ep": ep, "intervals_per_1000_steps": intervals, "per_1000_steps_bytes": intervals * plain,
            "per_1000_steps_bytes_with_ep": intervals * ep}


# --- (6) tracker keys --------------------------------------------------------------------------------------
def wandb_keys(line: dict[str, Any], metrics: dict[str, float], out: Path) -> dict[str, Any]:
    """The ``atlas/`` keys a real offline W&B run holds after ``WandbSink.log_load`` of an ordinary and of a picture
    interval, and the others in their history rows (wandb's own ``_`` keys left out), read back from the run's file
    (a fresh process: wandb's own service stays out of this one's timings)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "line.json").write_text(json.dumps({"line": line, "metrics": metrics}))
    code = f"""
import json, os, pathlib
os.environ["WANDB_SILENT"] = "true"
import wandb
from atlas_tracking.integrations.wandb import WandbSink
from atlas_tracking.testing.wandb_offline import read_wandb_offline
d = pathlib.Path({str(out)!r})
given = json.loads((d / "line.json").read_text())
run = wandb.init(mode="offline", dir=str(d), project="telemetry-cost")
sink = WandbSink(run)
sink.log_load(given["line"], given["metrics"], 50, False)
sink.log_load(given["line"], given["metrics"], 100, True)
run.finish()
rows = read_wandb_offline(next((d / "wandb").glob("offline-run-*")))["history"]
print(json.dumps([sorted(k for k in row if not k.startswith("_")) for row in rows]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return {"error": proc.stderr[-800:]}
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    ordinary, picture = ([k for k in row if k.startswith("atlas/")] for row in rows[:2])
    return {"ordinary_interval": len(ordinary), "picture_interval": len(picture),
            "picture_only": sorted(set(picture) - set(ordinary)),
            "other_keys_in_the_rows": sorted(set(rows[0]) - set(ordinary))}


def tracker_keys(line: dict[str, Any], out: Path, with_wandb: bool) -> dict[str, Any]:
    cfg = AtlasConfig.from_dict({})
    metrics = load_metrics(line, cfg.telemetry.top_experts)
    with_ep = copy.deepcopy(line)
    with_ep["layers"][0].update(ep_ranks=[0, 1], ep_tokens=[1, 2])
    for row in with_ep["layers"]:
        row["dropped"] = 0
    most = load_metrics(with_ep, cfg.telemetry.top_experts)
    result: dict[str, Any] = {
        "top_experts": cfg.telemetry.top_experts, "picture_every": cfg.telemetry.picture_every,
        "per_interval": len(metrics), "keys": sorted(metrics),
        "per_interval_with_ep_and_capacity": len(most),
        "naive_per_expert": NAIVE,
        "per_interval_over_naive": {k: len(metrics) / v for k, v in NAIVE.items()},
    }
    if with_wandb:
        result["wandb"] = wandb_keys(line, metrics, out / "wandb")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=16, help="intervals of 50 steps with the telemetry, each "
                    "interleaved with 50 without it, in the plain loop")
    ap.add_argument("--fit-pairs", type=int, default=6, help="on/off pairs of Lightning fits (0: none)")
    ap.add_argument("--fit-steps", type=int, default=100)
    ap.add_argument("--calls", type=int, default=2000, help="calls of the hooks and of a step that closes nothing")
    ap.add_argument("--forward-repeats", type=int, default=100)
    ap.add_argument("--close-repeats", type=int, default=20)
    ap.add_argument("--no-wandb", action="store_true", help="skip the keys of a real offline W&B run")
    ap.add_argument("--out", default=str(HERE / "telemetry_cost.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    result: dict[str, Any] = {
        "commit": commit.stdout.strip() or None, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "every_n_steps": EVERY,
        "model": f"demo Qwen3-MoE: d=64, 4 routed layers, E=32, k=2; batch {BATCH} x {WINDOW} tokens, AdamW",
        "deepseek_v3": DSV3, "global_batches_tokens": GLOBAL_BATCHES,
    }
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        print("parts ...", flush=True)
        result["parts"] = parts(args.calls, args.forward_repeats, out / "parts")
        print("close at the demo shape ...", flush=True)
        result["close_demo"] = close_cost("demo", build_qwen3_moe(seed=0), None, 0, 0, args.close_repeats, out)
        result["close_demo"].pop("line")
        print("close and bytes at the DeepSeek-V3 layout ...", flush=True)
        result["bytes"], result["close_deepseek_v3"] = {}, {}
        model = dsv3_model()
        for name, batch in GLOBAL_BATCHES.items():
            tokens = EVERY * batch
            counts = realistic_counts(DSV3["routed_layers"], DSV3["experts"], DSV3["top_k"], tokens)
            calls = EVERY * batch // 4096  # one router call per 4,096-token sequence, over every process
            written = close_cost(name, model, counts, tokens, calls, args.close_repeats, out)
            result["bytes"][name] = {"tokens_per_step": batch, "tokens_per_interval": tokens,
                                     "expert_load_mean": float(counts.mean()),
                                     **load_bytes(written, counts, out)}
            if name == next(iter(GLOBAL_BATCHES)):
                result["keys"] = tracker_keys(written["line"], out, not args.no_wandb)
            written.pop("line")
            result["close_deepseek_v3"][name] = written
        del model
        print("training steps ...", flush=True)
        result["steps"] = training_steps(args.pairs, out / "steps")
        if args.fit_pairs:
            print("Lightning fits ...", flush=True)
            result["fit"] = lightning_fit(args.fit_pairs, args.fit_steps)
    p = result["parts"]
    step_ms = result["steps"]["cpu"]["step_ms_off"]["median"]
    close_ms = result["close_demo"]["close_ms"]["cpu"]["median"]
    per_step_ms = p["hook_bodies_ms_per_forward_in_training"] + p["gate_step_us_no_close"] / 1000 + close_ms / EVERY
    result["accounted"] = {"per_step_ms": per_step_ms, "of_step": per_step_ms / step_ms,
                           "how": "hook bodies per forward (timed inside training passes) + AtlasGate.step that "
                                  "closes nothing + one close / 50, over the median step without telemetry (CPU time)"}
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
