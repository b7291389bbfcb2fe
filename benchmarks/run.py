"""Gate cost, measured: ``make bench`` (or ``python benchmarks/run.py``) writes ``benchmarks/results.json``.

(a) gate vs a plain no-grad forward over the same canary (same model, device, process; interleaved
    runs, median of several), with and without a baseline (drift) and with anchor collection;
(b) training overhead of AtlasCallback at the demo's cadence vs the same fit without it;
(c) peak memory of a gate vs the plain forward (CUDA: max_memory_allocated; CPU: peak RSS of a
    fresh subprocess);
(d) baseline artifact size;
(e) scaling over canary tokens and over the number of experts E;
(j) a fit against a tracker that never answers, against no tracker (``benchmarks/tracker_stall.py``).
(l) frontier layouts: bytes, memory and time per gate, fitted and extrapolated (``benchmarks/scale.py``).
(n) a gate's host memory at 24 routed layers x 128 experts, making, reading or without a baseline
    (``benchmarks/gate_memory.py``).
(o) between gates: the training-batch telemetry's cost per training step, one interval close, the bytes of
    ``load.jsonl`` and the tracker keys per interval at the DeepSeek-V3 layout (``benchmarks/telemetry_cost.py``).
Ratios are taken in one process; they are benchmarks, not timed tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from atlas_tracking import AtlasConfig, Baseline, Canary, measure
from atlas_tracking.testing.bench import host_description

HERE = Path(__file__).resolve().parent


QUIET = {"receipts": {"progress": False}}


def demo_model(experts: int = 32, hidden: int = 64, seed: int = 0, device: str = "cpu", dtype=torch.float32):
    from atlas_tracking.testing.lightning_lm import build_qwen3_moe

    return build_qwen3_moe(seed=seed, hidden=hidden, experts=experts, aux_coef=0.0).to(device, dtype).eval()


def demo_canary(n_windows: int = 64, window: int = 128) -> Canary:
    from atlas_tracking.testing.demo_data import encode, prose_text

    return Canary.from_token_ids(encode(prose_text()), window=window, n_windows=n_windows, seed=0)


def plain_forward(model, canary: Canary, batch_windows: int) -> None:
    device = next(model.parameters()).device
    with torch.no_grad():
        for s in range(0, canary.n_windows, batch_windows):
            ids = torch.from_numpy(canary.windows[s : s + batch_windows]).to(device)
            model(input_ids=ids, use_cache=False)
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, run round-robin (warm-up first) so drift hits all alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def gate_vs_forward(model, canary: Canary, repeats: int) -> dict:
    cfg = AtlasConfig.from_dict(QUIET)
    base = Baseline.from_report(measure(model, canary, config=cfg))
    bw = cfg.receipts.batch_windows
    t = interleaved({
        "plain_forward": lambda: plain_forward(model, canary, bw),
        "gate": lambda: measure(model, canary, config=cfg, keep_anchors=False),
        "gate_with_drift": lambda: measure(model, canary, baseline=base, config=cfg),
        "gate_collecting_baseline": lambda: measure(model, canary, config=cfg, keep_anchors=True),
    }, repeats)
    return {"seconds": t, "ratio_gate": t["gate"] / t["plain_forward"],
            "ratio_gate_with_drift": t["gate_with_drift"] / t["plain_forward"],
            "ratio_gate_collecting_baseline": t["gate_collecting_baseline"] / t["plain_forward"],
            "canary_tokens": canary.n_tokens}


def baseline_size(model, canary: Canary) -> dict:
    cfg = AtlasConfig.from_dict(QUIET)
    with tempfile.TemporaryDirectory() as d:
        path = Baseline.from_report(measure(model, canary, config=cfg)).save(Path(d) / "b")
        return {f.name: f.stat().st_size for f in path.iterdir()} | {"anchors": cfg.receipts.anchors}


_PEAK_CHILD = r"""
import json, runpy, torch
bench = runpy.run_path({run!r}, run_name="bench_run")
demo_model, realistic_model, demo_canary = bench["demo_model"], bench["realistic_model"], bench["demo_canary"]
plain_forward, QUIET = bench["plain_forward"], bench["QUIET"]
from atlas_tracking import AtlasConfig, measure
mode, spec = {mode!r}, {spec!r}
model = demo_model() if spec is None else realistic_model(**spec, device="cpu")
canary = demo_canary() if spec is None else demo_canary(n_windows={windows!r})
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key): return int(line.split()[1]) * 1024
cfg = AtlasConfig.from_dict(QUIET)
plain_forward(model, demo_canary(n_windows=1), 8)  # loads kernels and lazy state once, on one window
open('/proc/self/clear_refs', 'w').write('5')
before = status('VmRSS')
(plain_forward(model, canary, 8) if mode == 'plain' else measure(model, canary, config=cfg, keep_anchors=False))
print(json.dumps({{'peak_over_start': status('VmHWM') - before}}))
"""


def cuda_peak(fn) -> int:
    """Bytes ``fn`` allocates at its peak on the current CUDA device beyond what was allocated before it (after a
    first call, so that nothing it keeps is counted)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fn()
    return torch.cuda.max_memory_allocated() - start


def peak_memory(model, canary: Canary, spec: dict | None = None, windows: int = 64) -> dict:
    """Peak memory of a plain forward and of a gate over the canary (``spec``: a realistic model, on CPU
    rebuilt in each child process)."""
    device = next(model.parameters()).device
    cfg = AtlasConfig.from_dict(QUIET)
    if device.type == "cuda":
        out = {"plain_forward": cuda_peak(lambda: plain_forward(model, canary, 8)),
               "gate": cuda_peak(lambda: measure(model, canary, config=cfg, keep_anchors=False))}
        return out | {"ratio": out["gate"] / max(out["plain_forward"], 1), "how": "cuda max_memory_allocated"}
    out = {}
    for mode in ("plain", "gate"):
        code = _PEAK_CHILD.format(run=str(HERE / "run.py"), mode=mode, spec=spec,
                                  windows=windows)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            return {"error": proc.stderr[-500:]}
        out["plain_forward" if mode == "plain" else "gate"] = json.loads(proc.stdout.strip().splitlines()[-1])[
            "peak_over_start"]
    return out | {"ratio": out["gate"] / max(out["plain_forward"], 1),
                  "how": "peak RSS above the start (model built, one-window forward done), fresh subprocess each"}


REALISTIC = {
    "cuda": {"hidden": 2048, "moe_intermediate": 768, "experts": (64, 128, 256), "top_k": 8, "layers": 8,
             "dtype": "bfloat16", "windows": 64},
    "cpu": {"hidden": 1024, "moe_intermediate": 384, "experts": (64,), "top_k": 8, "layers": 2,
            "dtype": "float32", "windows": 16},
}
"""Realistic width (Qwen3-30B-A3B-like experts: d=2048, 768-wide experts, k=8) on a GPU; a reduced
version of it on CPU, where the full one does not fit in a benchmark's time."""


def realistic_model(hidden: int, moe_intermediate: int, experts: int, top_k: int, layers: int, dtype: str,
                    device: str = "cpu"):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=4 * moe_intermediate,
        moe_intermediate_size=moe_intermediate, num_hidden_layers=layers, num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 512), head_dim=128, num_experts=experts, num_experts_per_tok=top_k,
        max_position_embeddings=4096, tie_word_embeddings=True,
    )
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg)
    return model.to(getattr(torch, dtype)).eval()


def realistic(device: str, repeats: int) -> dict:
    """Gate vs plain forward at realistic width, one row per expert count, with peak memory."""
    spec = REALISTIC["cuda" if device.startswith("cuda") else "cpu"]
    canary = demo_canary(n_windows=spec["windows"])
    rows = []
    for e in spec["experts"]:
        shape = {"hidden": spec["hidden"], "moe_intermediate": spec["moe_intermediate"], "experts": e,
                 "top_k": spec["top_k"], "layers": spec["layers"], "dtype": spec["dtype"]}
        model = realistic_model(**shape, device=device)
        t = interleaved({"plain": lambda m=model: plain_forward(m, canary, 8),
                         "gate": lambda m=model: measure(m, canary, config=AtlasConfig.from_dict(QUIET),
                                                         keep_anchors=False)}, repeats)
        memory = peak_memory(model, canary, spec=shape, windows=spec["windows"])
        rows.append({"experts": e, **t, "ratio": t["gate"] / t["plain"], "peak_memory": memory})
        del model
    return {**{k: v for k, v in spec.items() if k != "experts"}, "canary_tokens": canary.n_tokens, "rows": rows}


def training_overhead(steps: int, every: int) -> dict:
    """The demo's pretraining recipe for ``steps`` steps, with and without AtlasCallback (same seed)."""
    import warnings

    import lightning.pytorch as pl
    from atlas_tracking.integrations.lightning import AtlasCallback

    from atlas_tracking.testing.demo_data import encode, prose_text
    from atlas_tracking.testing.lightning_lm import MoELM, build_qwen3_moe, loaders

    warnings.filterwarnings("ignore")
    prose = encode(prose_text())
    canary = demo_canary()
    train, val = loaders(prose[:360_000], prose[360_000:400_000], window=128, batch=16, steps=steps, seed=0)
    times, gate_seconds, gate_count = {}, [], []
    for label in ("without", "with", "without_again", "with_again"):
        pl.seed_everything(0, verbose=False)
        cbs = [AtlasCallback(canary, {"receipts": {"progress": False}})] if label in ("with", "with_again") else []
        with tempfile.TemporaryDirectory() as d:
            trainer = pl.Trainer(max_steps=steps, val_check_interval=every, check_val_every_n_epoch=None, logger=False,
                                 default_root_dir=d, callbacks=cbs, enable_progress_bar=False,
                                 enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1,
                                 enable_checkpointing=False)
            t0 = time.perf_counter()
            trainer.fit(MoELM(build_qwen3_moe(seed=0)), train, val)
            times[label] = time.perf_counter() - t0
            if cbs:
                gate_seconds.append(cbs[0].gate.seconds_total)
                gate_count.append(cbs[0].gate.gates_run)
    without = min(times["without"], times["without_again"])
    with_cb = min(times["with"], times["with_again"])
    return {"seconds": times, "overhead_fraction": (with_cb - without) / without, "steps": steps,
            "gate_every_steps": every, "gates": gate_count[0],
            "gate_seconds_in_fit": gate_seconds,
            "gate_time_fraction": min(gate_seconds) / without}


def tracker_stall() -> dict:
    """(j) A fit against a tracker that accepts connections and never answers, against no tracker: run by
    ``benchmarks/tracker_stall.py`` in a fresh process (its stalled tracker calls die with it)."""
    out = HERE / "tracker_stall.json"
    subprocess.run([sys.executable, str(HERE / "tracker_stall.py"), "--out", str(out)], check=True, timeout=3600)
    return json.loads(out.read_text())


def frontier_scale() -> dict:
    """(l) Frontier layouts at reduced width, fitted and extrapolated: run by ``benchmarks/scale.py`` in a fresh
    process (its points in one more of their own)."""
    out = HERE / "scale.json"
    subprocess.run([sys.executable, str(HERE / "scale.py"), "--out", str(out)], check=True, timeout=3600)
    return json.loads(out.read_text())["extrapolated"]


def gate_memory() -> dict:
    """(n) A gate's host memory at 24 routed layers x 128 experts: run by ``benchmarks/gate_memory.py``, each case
    in fresh processes of its own."""
    out = HERE / "gate_memory.json"
    subprocess.run([sys.executable, str(HERE / "gate_memory.py"), "--out", str(out)], check=True, timeout=3600)
    return json.loads(out.read_text())


def telemetry_cost() -> dict:
    """(o) Between gates: run by ``benchmarks/telemetry_cost.py`` in a fresh process (one torch thread)."""
    out = HERE / "telemetry_cost.json"
    subprocess.run([sys.executable, str(HERE / "telemetry_cost.py"), "--out", str(out)], check=True, timeout=3600)
    result = json.loads(out.read_text())
    return {key: result[key] for key in ("commit", "accounted", "steps", "fit", "close_demo", "bytes", "keys")
            if key in result}


def scaling(repeats: int) -> dict:
    out = {"canary_tokens": [], "experts": []}
    model = demo_model()
    for n in (8, 16, 32, 64, 128):
        canary = demo_canary(n_windows=n)
        t = interleaved({"plain": lambda c=canary: plain_forward(model, c, 8),
                         "gate": lambda c=canary: measure(model, c, config=AtlasConfig.from_dict(QUIET),
                                                          keep_anchors=False)}, repeats)
        out["canary_tokens"].append({"tokens": canary.n_tokens, **t, "ratio": t["gate"] / t["plain"]})
    canary = demo_canary(n_windows=32)
    for e in (8, 32, 64, 128, 256):
        m = demo_model(experts=e)
        t = interleaved({"plain": lambda m=m: plain_forward(m, canary, 8),
                         "gate": lambda m=m: measure(m, canary, config=AtlasConfig.from_dict(QUIET),
                                                     keep_anchors=False)}, repeats)
        out["experts"].append({"experts": e, **t, "ratio": t["gate"] / t["plain"]})
    out["width"] = []
    for hidden in (64, 256, 512):
        m = demo_model(hidden=hidden)
        t = interleaved({"plain": lambda m=m: plain_forward(m, canary, 8),
                         "gate": lambda m=m: measure(m, canary, config=AtlasConfig.from_dict(QUIET),
                                                     keep_anchors=False)}, repeats)
        out["width"].append({"hidden": hidden, **t, "ratio": t["gate"] / t["plain"]})
    tokens = np.array([r["tokens"] for r in out["canary_tokens"]], float)
    gate = np.array([r["gate"] for r in out["canary_tokens"]])
    slope, intercept = np.polyfit(tokens, gate, 1)
    pred = slope * tokens + intercept
    out["linear_fit_tokens"] = {"seconds_per_1k_tokens": 1000 * slope, "intercept_s": intercept,
                                "r2": float(1 - ((gate - pred) ** 2).sum() / ((gate - gate.mean()) ** 2).sum())}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "results.json"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--train-steps", type=int, default=600)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-tracker-stall", action="store_true", help="skip (j), a tracker that never answers")
    parser.add_argument("--skip-scale", action="store_true", help="skip (l), the frontier layouts' cost model")
    parser.add_argument("--skip-telemetry", action="store_true", help="skip (o), the telemetry between gates")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model, canary = demo_model(device=args.device), demo_canary()
    results = {
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "cpu": host_description()["cpu"], "threads": torch.get_num_threads(),
        "torch": torch.__version__, "model": "demo Qwen3-MoE: d=64, 4 routed layers, E=32, k=2",
    }
    print("(a) gate vs plain forward ...", flush=True)
    results["gate_vs_forward"] = gate_vs_forward(model, canary, args.repeats)
    print("(c) peak memory ...", flush=True)
    results["peak_memory"] = peak_memory(model, canary)
    print("(d) baseline size ...", flush=True)
    results["baseline_bytes"] = baseline_size(model, canary)
    print("(e) scaling ...", flush=True)
    results["scaling"] = scaling(max(3, args.repeats // 2))
    print("(f) realistic width ...", flush=True)
    results["realistic"] = realistic(args.device, max(3, args.repeats // 2))
    if not args.skip_training:
        print("(b) training overhead ...", flush=True)
        results["training_overhead"] = training_overhead(args.train_steps, 200)
    if not args.skip_tracker_stall:
        print("(j) a tracker that never answers ...", flush=True)
        results["tracker_stall"] = tracker_stall()
    if not args.skip_scale:
        print("(l) frontier layouts ...", flush=True)
        results["frontier_scale"] = frontier_scale()
    print("(n) a gate's host memory ...", flush=True)
    results["gate_memory"] = gate_memory()
    if not args.skip_telemetry:
        print("(o) the telemetry between gates ...", flush=True)
        results["telemetry_cost"] = telemetry_cost()
    Path(args.out).write_text(json.dumps(results, indent=1))
    g = results["gate_vs_forward"]
    print(f"gate / plain forward = {g['ratio_gate']:.2f} (with drift {g['ratio_gate_with_drift']:.2f}); "
          f"peak memory ratio = {results['peak_memory'].get('ratio', float('nan')):.2f}")
    if "training_overhead" in results:
        o = results["training_overhead"]
        print(f"training overhead = {100 * o['overhead_fraction']:.2f}% (fit times); "
              f"time inside gates = {100 * o['gate_time_fraction']:.2f}% of the fit")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
