"""Expert parallelism and world size, measured: ``python benchmarks/expert_parallel.py`` writes
``benchmarks/expert_parallel.json``.

(a) Bytes per gate and layer: what a gate's field exchange sends between processes
    (``atlas_tracking.engine.fields.ExpertParallelFields``: request counts, rows and expert ids, answers) beside
    what the forward's own expert dispatch sends over the same canary (DeepSpeed MoE: two all_to_all of
    capacity-sized ``[E, C, d]`` buffers per layer; AutoEP: two variable all_to_all of the routed rows;
    Megatron-Core allgather dispatcher: gather of the tokens, routing map and probabilities, reduce-scatter
    of the outputs). Bytes are those a process sends to the *other* processes, summed over processes,
    counted by wrapping the torch.distributed collectives; the field exchange is told apart by its caller.
(b) Gate time under EP=2 (2 gloo processes, one thread each) against EP=1 (the same weights in one
    process, one thread): a plain no-grad forward over the canary and a gate, interleaved, median of
    ``--repeats``; a multi-process time is the slowest process's.
(c) Receipts on 1, 2 and 4 processes: the largest deviation per receipt between any two of them, over
    a replicated Qwen3-MoE, DeepSpeed MoE with ep_size = world, and FSDP2 (``fully_shard``), each with a
    baseline gate and a drift gate. The one process runs with torch's default threads (as a user runs
    it), each of 2 and 4 processes with one.

Processes are gloo workers on this machine (atlas_tracking.testing.distributed); the models are the tests' models
(atlas_tracking.testing.parallel_models), every weight seeded by its global name, so all placements hold the same weights.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import atlas_tracking.testing.parallel_models as pm
from atlas_tracking import AtlasConfig, Baseline, Canary, measure
from atlas_tracking.engine.measure import micro_batches
from atlas_tracking.testing.bench import host_description
from atlas_tracking.testing.distributed import run_workers
from atlas_tracking.testing.tolerance import FLOAT_TOL, deviations

HERE = Path(__file__).resolve().parent


WINDOW, N_WINDOWS, BATCH_WINDOWS = 64, 32, 4
"""The benchmark canary: 32 windows of 64 tokens, micro-batches of 4 windows (8 per gate)."""


def bench_canary() -> Canary:
    return Canary.from_token_ids(np.random.default_rng(0).integers(0, 64, 40_000), window=WINDOW,
                                 n_windows=N_WINDOWS, seed=0)


def bench_config() -> AtlasConfig:
    return AtlasConfig.from_dict({"receipts": {"progress": False, "n_bootstrap": 200, "batch_windows": BATCH_WINDOWS}})


class CollectiveBytes:
    """Bytes each collective sends to other processes, keyed by phase and routed layer (set by pre-hooks)."""

    def __init__(self) -> None:
        self.phase, self.layer = "forward", -1
        self.bytes: dict[str, dict[int, int]] = {}
        self.in_fields = False

    def add(self, sent: int) -> None:
        phase = f"{self.phase}:{'exchange' if self.in_fields else 'dispatch'}"
        per_layer = self.bytes.setdefault(phase, {})
        per_layer[self.layer] = per_layer.get(self.layer, 0) + int(sent)

    @contextlib.contextmanager
    def installed(self, blocks: list[torch.nn.Module]):
        import torch.distributed as dist

        from atlas_tracking.engine.fields import ExpertParallelFields

        saved = {name: getattr(dist, name) for name in
                 ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather")}
        saved_exchange = ExpertParallelFields._exchange

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            size, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
            row = input[0].numel() * input.element_size() if input.shape[0] else 0
            own = input_split_sizes[rank] if input_split_sizes else input.shape[0] // size
            self.add((input.shape[0] - own) * row)
            return saved["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, group=group, **kw)

        def all_gather_into_tensor(output, input, group=None, **kw):
            self.add(input.numel() * input.element_size() * (dist.get_world_size(group=group) - 1))
            return saved["all_gather_into_tensor"](output, input, group=group, **kw)

        def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, **kw):
            size = dist.get_world_size(group=group)
            self.add(input.numel() * input.element_size() * (size - 1) // size)
            return saved["reduce_scatter_tensor"](output, input, op=op, group=group, **kw)

        def all_gather(tensor_list, tensor, group=None, **kw):
            self.add(tensor.numel() * tensor.element_size() * (len(tensor_list) - 1))
            return saved["all_gather"](tensor_list, tensor, group=group, **kw)

        def exchange(fields, send, send_splits, recv_splits):
            self.in_fields = True
            try:
                return saved_exchange(fields, send, send_splits, recv_splits)
            finally:
                self.in_fields = False

        handles = [b.register_forward_pre_hook(lambda m, a, i=i: setattr(self, "layer", i)) for i, b in enumerate(blocks)]
        counting = {"all_to_all_single": all_to_all_single, "all_gather_into_tensor": all_gather_into_tensor,
                    "reduce_scatter_tensor": reduce_scatter_tensor, "all_gather": all_gather}
        for name, fn in counting.items():
            setattr(dist, name, fn)
        # Megatron binds its gather and reduce-scatter functions at import: count those names too
        mappings = sys.modules.get("megatron.core.tensor_parallel.mappings")
        bound = {} if mappings is None else {"dist_all_gather_func": all_gather_into_tensor,
                                              "dist_reduce_scatter_func": reduce_scatter_tensor}
        saved_bound = {name: getattr(mappings, name) for name in bound}
        for name, fn in bound.items():
            setattr(mappings, name, fn)
        ExpertParallelFields._exchange = exchange
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
            for name, fn in saved_bound.items():
                setattr(mappings, name, fn)
            ExpertParallelFields._exchange = saved_exchange
            for h in handles:
                h.remove()


def _plain_forward(model: torch.nn.Module, canary: Canary, rank: int, world: int, forward) -> None:
    """The forward calls a gate makes on this rank, without the gate."""
    from atlas_tracking.engine.measure import _forward_ids

    model.eval()
    with torch.no_grad():
        for batch in micro_batches(canary, rank, world, BATCH_WINDOWS):
            forward(model, torch.from_numpy(_forward_ids(canary, batch)))


def _slowest(seconds: float) -> float:
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def _timed(fn) -> float:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    t0 = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - t0)


def _build(family: str, rank: int, world: int, stack: contextlib.ExitStack):
    """(module to measure, its MoE blocks, forward(model, ids)) for one family at ``ep_size = world``."""
    from atlas_tracking.engine.measure import default_forward

    if family == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        model = pm.ds_moe(world, rank, d=64)
        if world > 1:
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
                "train_batch_size": world, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}})
            model = engine.module
        blocks = [b.moe for b in model.blocks]
    elif family == "autoep":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        model = pm.autoep(world, rank, d=64)
        blocks = [m for m in model.modules() if type(m).__name__ == "AutoEPMoELayer"]
    elif family == "megatron":
        stack.enter_context(pm.megatron_on_cpu(world))
        model = pm.megatron_stack(world, rank, d=64)
        blocks = [layer.mlp for layer in model.layers]
    else:
        raise ValueError(family)
    return model.eval(), blocks, default_forward


def ep_worker(rank: int, world: int, family: str, repeats: int) -> dict[str, Any]:
    """Bytes of one gate and of its forward calls, per layer, and interleaved timings."""
    with contextlib.ExitStack() as stack:
        return _ep_measurements(rank, world, repeats, *_build(family, rank, world, stack))


def _ep_measurements(rank: int, world: int, repeats: int, model, blocks, forward) -> dict[str, Any]:
    canary, cfg = bench_canary(), bench_config()
    counter = CollectiveBytes()
    with counter.installed(blocks):
        counter.phase = "forward"
        _plain_forward(model, canary, rank, world, forward)
        counter.phase = "gate"  # a first gate: it also collects the baseline's anchors (their fields included)
        measure(model, canary, config=cfg)
        counter.phase = "gate_without_anchors"
        measure(model, canary, config=cfg, keep_anchors=False)
    per_phase = {}
    for phase in ("forward:dispatch", "gate:dispatch", "gate:exchange", "gate_without_anchors:exchange"):
        layers = counter.bytes.get(phase, {})
        t = torch.tensor([layers.get(i, 0) for i in range(len(blocks))], dtype=torch.int64)
        if world > 1:
            torch.distributed.all_reduce(t)
        per_phase[phase] = t.tolist()
    times: dict[str, list[float]] = {"plain_forward": [], "gate": []}  # gate: the first gate's work (anchors too)
    _timed(lambda: measure(model, canary, config=cfg))  # warm-up
    for _ in range(repeats):
        times["plain_forward"].append(_timed(lambda: _plain_forward(model, canary, rank, world, forward)))
        times["gate"].append(_timed(lambda: measure(model, canary, config=cfg)))
    return {"bytes_per_layer": per_phase, "seconds": {k: statistics.median(v) for k, v in times.items()},
            "layers": len(blocks)}


def expert_parallel(family: str, repeats: int) -> dict[str, Any]:
    one = run_workers(ep_worker, 1, family, repeats, timeout=1200)[0]
    two = run_workers(ep_worker, 2, family, repeats, timeout=1200)[0]
    b = two["bytes_per_layer"]
    dispatch = b["forward:dispatch"]
    return {
        "ep1_seconds": one["seconds"], "ep2_seconds": two["seconds"],
        "gate_time_ep2_over_ep1": two["seconds"]["gate"] / one["seconds"]["gate"],
        "forward_dispatch_bytes_per_layer": dispatch,
        "gate_own_dispatch_bytes_per_layer": b["gate:dispatch"],
        "gate_exchange_bytes_per_layer": b["gate:exchange"],
        "gate_exchange_bytes_per_layer_without_anchors": b["gate_without_anchors:exchange"],
        "exchange_over_dispatch": [e / f for e, f in zip(b["gate:exchange"], dispatch)],
        "exchange_over_dispatch_without_anchors": [e / f for e, f in zip(b["gate_without_anchors:exchange"], dispatch)],
    }


# --- (c) receipts across world sizes ------------------------------------------------------------

def _gates(model: torch.nn.Module, canary: Canary, perturb) -> list[dict[str, Any]]:
    cfg = pm.config(2)
    gate0 = measure(model, canary, config=cfg)
    perturb()
    gate1 = measure(model, canary, baseline=Baseline.from_report(gate0), config=cfg)
    return [json.loads(gate0.to_json()), json.loads(gate1.to_json())]


def world_worker(rank: int, world: int, setup: str) -> list[dict[str, Any]] | None:
    canary = pm.canary(16)
    if setup == "replicated":
        model = pm.qwen3_moe()
        gates = _gates(model, canary, lambda: pm.fill_(model, lambda n: n, perturb=0.05))
    elif setup == "deepspeed_ep":
        out = pm.ds_expert_parallel(rank, world, 8, 16, 2)
        gates = [out["gate0"], out["gate1"]]
    elif setup == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = pm.qwen3_moe()
        if world > 1:
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        gates = _gates(model, canary, lambda: pm.fill_(model, lambda n: n, perturb=0.05))
    else:
        raise ValueError(setup)
    return gates if rank == 0 else None


def world_sizes(worlds: tuple[int, ...]) -> dict[str, Any]:
    """Largest deviation per receipt between any two world sizes, per set-up and over all of them."""
    out: dict[str, Any] = {"per_setup": {}, "max": {}}
    for setup in ("replicated", "deepspeed_ep", "fsdp2"):
        runs = {w: run_workers(world_worker, w, setup, timeout=1200, threads=None if w == 1 else 1)[0]
                for w in worlds}
        rows = {}
        for i, a in enumerate(worlds):
            for b in worlds[i + 1:]:
                devs: dict[str, float] = {}
                for ref, gate in zip(runs[a], runs[b]):
                    for name, dev in deviations(ref, gate).items():
                        if name != "_violations":
                            devs[name] = max(devs.get(name, 0.0), dev)
                rows[f"{a}_vs_{b}"] = devs
                for name, dev in devs.items():
                    out["max"][name] = max(out["max"].get(name, 0.0), dev)
        out["per_setup"][setup] = rows
    out["tolerance"] = FLOAT_TOL
    out["within_tolerance"] = all(v <= FLOAT_TOL for v in out["max"].values())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "expert_parallel.json"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--parts", default="ep,world", help="ep (a, b), world (c), or both; others kept from --out")
    parser.add_argument("--families", default="deepspeed,autoep,megatron", help="expert-parallel families for ep")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    previous = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    results: dict[str, Any] = {**previous,
        "cpu": host_description()["cpu"], "torch": torch.__version__, "threads_per_process": 1,
        "canary": f"{N_WINDOWS} windows x {WINDOW} tokens, {BATCH_WINDOWS} windows per micro-batch",
        "models": {"deepspeed": "DeepSpeed MoE: d=64, 2 layers, E=8, k=2, capacity factor 1 (eval)",
                   "autoep": "Qwen3-MoE with AutoEP layers: d=64, 2 layers, E=8, k=2",
                   "megatron": "Megatron-Core MoELayer stack: d=64, 2 layers, E=8, k=2, SequentialMLP, allgather "
                               "dispatcher (CPU stand-ins of tests/parallel_models.megatron_on_cpu)"},
    }
    families = args.families.split(",") if "ep" in parts else []
    for family in families:
        print(f"(a, b) {family} EP=1 vs EP=2 ...", flush=True)
        results[family] = expert_parallel(family, args.repeats)
    if "world" in parts:
        print("(c) receipts on 1, 2 and 4 processes ...", flush=True)
        results["world_sizes"] = world_sizes((1, 2, 4))
    Path(args.out).write_text(json.dumps(results, indent=1))
    for family in families:
        r = results[family]
        print(f"{family}: exchange/dispatch bytes per layer {r['exchange_over_dispatch']}; gate EP=2 / EP=1 = "
              f"{r['gate_time_ep2_over_ep1']:.2f}")
    print(f"world sizes: every receipt within {FLOAT_TOL:g}: {results['world_sizes']['within_tolerance']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
