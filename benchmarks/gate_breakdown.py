"""Where a gate's time goes beyond the plain forward, part by part, in one process.

``python benchmarks/gate_breakdown.py --width 64`` writes ``benchmarks/gate_breakdown_w64.json``: for a freshly
initialised Qwen3-MoE (24 routed layers x 128 experts, k = 8, float32, ``--width`` wide) over a 32 x 128-token canary in
micro-batches of 8 windows (``--batch-windows``, in both passes), the CPU seconds of a plain no-grad forward and of its
experts' calls, and of a gate (no baseline, eager field arithmetic) split into: the experts' products (the active
fields, read as the model's own experts code computes them, with the self-check's sample in the same pass,
``adapters/grouped_experts.py``, and each layer's competitors in one pooled call, ``engine/pooled_competitors.py``), the
per-token field arithmetic (``receipts/field_chunk.py``: the chunks' and the competitors' distances), the re-route of
the post-update state for ``ov_cf`` (the model's norm and router), the self-check, the report built on the host from the
read-back (``build_report``: the window bootstrap of every receipt), and the rest. Each part is timed by wrapping the
engine's functions for the run (a benchmark-only instrument: the timers' own cost, a few microseconds a call, falls into
the parts), the passes interleaved, the medians of ``--repeats``; every part is also given over the plain forward's
time. One torch thread; the result names the host's CPU. Results in ``benchmarks/RESULTS.md`` (t), (u), (z) and
(aa).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from atlas_tracking import AtlasConfig, measure
from atlas_tracking.adapters.hf import HFLayer
from atlas_tracking.engine import capture, pooled_competitors
from atlas_tracking.engine import measure as measure_module
from atlas_tracking.engine.kernels import ChunkKernels
from atlas_tracking.engine.selfcheck import SelfCheck
from atlas_tracking.testing.bench import gate_bench_inputs, plain_forward, write_result

HERE = Path(__file__).resolve().parent
LAYERS, EXPERTS, TOP_K, WINDOWS, BATCH = 24, 128, 8, 32, 8


class PartTimer:
    """CPU seconds spent inside wrapped functions, by part (a call inside another wrapped call counts once, in the
    innermost part, and is taken out of the outer one)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []  # CPU seconds of inner parts, per open call

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` timed into ``part``."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.process_time() - t0
                inner = self._stack.pop()
                self.seconds[part] += spent - inner
                if self._stack:
                    self._stack[-1] += spent

        return timed

    def run(self, fn: Callable[[], Any]) -> dict[str, float]:
        """CPU seconds of ``fn()`` by part, with ``total`` and ``rest`` (outside every wrapped call)."""
        self.seconds.clear()
        t0 = time.process_time()
        fn()
        total = time.process_time() - t0
        return {**self.seconds, "total": total, "rest": total - sum(self.seconds.values())}


PARTS: list[tuple[type | ModuleType, str, str]] = [
    (HFLayer, "grouped_outputs", "experts"), (capture.LayerCapture, "_pair_call", "experts"),
    (HFLayer, "grouped_pair_outputs", "experts"), (ChunkKernels, "__call__", "field_arithmetic"),
    (pooled_competitors, "adjacent_receipts", "field_arithmetic"), (pooled_competitors, "random_distance",
    "field_arithmetic"), (capture, "random_distance", "field_arithmetic"), (HFLayer, "route_active", "reroute_ov_cf"),
    (SelfCheck, "observe", "selfcheck"), (capture.LayerCapture, "compute", "receipts_per_window"),
    (capture.LayerCapture, "select", "selection"), (measure_module, "build_report", "report"),
]
"""The engine's functions a gate's parts are timed in: (class or module, function, part)."""


@contextlib.contextmanager
def instrumented(timer: PartTimer) -> Iterator[None]:
    """The gate's parts' functions (:data:`PARTS`) wrapped by ``timer`` inside the block, the engine's own again
    after it (a benchmark-only instrument)."""
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in PARTS]
    for owner, name, part in PARTS:
        setattr(owner, name, timer.wrap(part, getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def own_experts_timed(timer: PartTimer, experts: list[torch.nn.Module], run: Callable[[], Any]) -> Any:
    """``run()`` with the model's own experts calls timed as ``experts_own`` (a plain forward: in a gate, the
    capture stands in for them and its calls are timed as its own parts)."""
    own = [module.__dict__.get("forward") for module in experts]  # an instance's own forward, where it has one
    for module in experts:
        module.forward = timer.wrap("experts_own", module.forward)
    try:
        return run()
    finally:
        for module, forward in zip(experts, own):
            if forward is None:
                del module.forward
            else:
                module.forward = forward


def one_width(width: int, repeats: int, batch: int = BATCH) -> dict[str, Any]:
    model, canary = gate_bench_inputs(width, LAYERS, EXPERTS, TOP_K, WINDOWS)
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "kernels": "eager", "batch_windows": batch}})
    timer = PartTimer()
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    passes = {"plain": lambda: own_experts_timed(timer, experts, lambda: plain_forward(model, canary, batch)),
              "gate": lambda: measure(model, canary, config=cfg, keep_anchors=False)}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in passes}
    with instrumented(timer):
        for run in passes.values():  # warm-up
            run()
        for _ in range(repeats):
            for name, run in passes.items():
                runs[name].append(timer.run(run))
    med = {name: {part: statistics.median(r.get(part, 0.0) for r in rs) for part in sorted({p for r in rs for p in r})}
           for name, rs in runs.items()}
    plain = med["plain"]["total"]
    own = med["plain"].get("experts_own", 0.0)
    gate = med["gate"]
    return {
        "plain_seconds": {"total": plain, "experts_own": own},
        "gate_seconds": gate,
        "gate_over_plain": gate["total"] / plain,
        "over_plain_forward": {part: seconds / plain for part, seconds in gate.items()},
        "experts_over_own": gate.get("experts", 0.0) / own,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-windows", type=int, default=BATCH, help="canary windows a forward call (both passes)")
    ap.add_argument("--out", default=None, help="default benchmarks/gate_breakdown_w{width}.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result = {"torch_threads": 1, "repeats": args.repeats, "layers": LAYERS,
              "experts": EXPERTS, "top_k": TOP_K, "width": args.width, "canary_windows": WINDOWS,
              "batch_windows": args.batch_windows, "kernels": "eager",
              **one_width(args.width, args.repeats, args.batch_windows)}
    write_result(result, args.out or HERE / f"gate_breakdown_w{args.width}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
