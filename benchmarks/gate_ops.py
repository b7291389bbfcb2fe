"""The operators a gate runs beyond a plain forward: counts and self time per operator, and their shapes.

``python benchmarks/gate_ops.py --width 64`` writes ``benchmarks/gate_ops_w64.json``: for a freshly initialised
Qwen3-MoE (24 routed layers x 128 experts, k = 8, float32, ``--width`` wide) over a 32 x 128-token canary in
micro-batches of 8 windows, ``torch.profiler``'s CPU self time and call count of every operator in a plain no-grad
forward and in a gate (no baseline, no anchors kept, the field arithmetic as ``--kernels`` chooses), per pass, the
mean of ``--repeats`` profiled passes of each, interleaved, after a warm-up. ``operators`` lists the ``--top``
operators with the most self time in a gate beyond the forward's (``extra_ms``), ``shapes`` the costliest input
shapes of the first ``--shapes`` of them in the gate. The profiler's own cost is in every operator's time, so
``self_ms_total`` is the profiled passes' sum, not a pass's time unprofiled (``gate_ablation.py`` and
``gate_fresh_processes.py`` give those); what this instrument answers is which operators, how many calls and how
much of the gate's excess each holds. One torch thread. Results in ``benchmarks/RESULTS.md`` (x).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from atlas_tracking import AtlasConfig, measure
from atlas_tracking.engine.kernels import PROCESS_KERNELS
from atlas_tracking.testing.bench import gate_bench_inputs, plain_forward, write_result

HERE = Path(__file__).resolve().parent
LAYERS, EXPERTS, TOP_K, WINDOWS = 24, 128, 8, 32


def profiled(run: Callable[[], Any]) -> Any:
    """``torch.profiler``'s CPU events of one ``run()``, with input shapes."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    return prof


def per_pass(events: Iterable[Any], passes: int, by_shape: bool = False) -> dict[Any, tuple[float, float]]:
    """``{operator: (calls, self ms)}`` per pass from ``key_averages()`` events of ``passes`` profiled passes; with
    ``by_shape``, keyed by ``(operator, input shapes)`` from ``key_averages(group_by_input_shape=True)`` events.

    >>> from types import SimpleNamespace as E
    >>> per_pass([E(key="aten::mm", count=4, self_cpu_time_total=3000.0)], passes=2)
    {'aten::mm': (2.0, 1.5)}
    """
    out: dict[Any, tuple[float, float]] = {}
    for e in events:
        key = (e.key, str(e.input_shapes)) if by_shape else e.key
        calls, ms = out.get(key, (0.0, 0.0))
        out[key] = (calls + e.count / passes, ms + e.self_cpu_time_total / 1e3 / passes)
    return out


def operator_table(gate: dict[str, tuple[float, float]], forward: dict[str, tuple[float, float]], top: int
                   ) -> list[dict[str, Any]]:
    """The ``top`` operators with the most self time in the gate beyond the forward's, most first.

    >>> operator_table({"mm": (3.0, 5.0), "add": (1.0, 1.0)}, {"mm": (1.0, 2.0)}, top=1)
    [{'operator': 'mm', 'gate_calls': 3.0, 'gate_ms': 5.0, 'forward_calls': 1.0, 'forward_ms': 2.0, 'extra_ms': 3.0}]
    """
    rows = []
    for name, (calls, ms) in gate.items():
        f_calls, f_ms = forward.get(name, (0.0, 0.0))
        rows.append({"operator": name, "gate_calls": round(calls, 1), "gate_ms": round(ms, 2),
                     "forward_calls": round(f_calls, 1), "forward_ms": round(f_ms, 2), "extra_ms": round(ms - f_ms, 2)})
    return sorted(rows, key=lambda r: -r["extra_ms"])[:top]


def costliest_shapes(shapes: dict[tuple[str, str], tuple[float, float]], operator: str, n: int = 4
                     ) -> list[dict[str, Any]]:
    """The ``n`` input shapes of ``operator`` with the most self time in :func:`per_pass`'s table by shape.

    >>> costliest_shapes({("mm", "[[2, 3], [3, 4]]"): (1.0, 2.0), ("mm", "[[1, 3], [3, 4]]"): (5.0, 1.0)}, "mm", n=1)
    [{'input_shapes': '[[2, 3], [3, 4]]', 'calls': 1.0, 'self_ms': 2.0}]
    """
    rows = [{"input_shapes": shape, "calls": round(calls, 1), "self_ms": round(ms, 2)}
            for (op, shape), (calls, ms) in shapes.items() if op == operator]
    return sorted(rows, key=lambda r: -r["self_ms"])[:n]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=64, help="the model's width")
    ap.add_argument("--repeats", type=int, default=3, help="profiled passes of each, interleaved")
    ap.add_argument("--top", type=int, default=30, help="operators listed")
    ap.add_argument("--shapes", type=int, default=12, help="operators whose costliest input shapes are listed")
    ap.add_argument("--kernels", choices=("auto", "compiled", "eager"), default="auto",
                    help="receipts.kernels (docs/receipts.md#field-kernels); auto is eager on the CPU")
    ap.add_argument("--out", default=None, help="default: benchmarks/gate_ops_w<width>.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, canary = gate_bench_inputs(args.width, LAYERS, EXPERTS, TOP_K, WINDOWS)
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "kernels": args.kernels}})
    passes = {"forward": lambda: plain_forward(model, canary, cfg.receipts.batch_windows),
              "gate": lambda: measure(model, canary, config=cfg, keep_anchors=False)}
    warm = {name: run() for name, run in passes.items()}  # a compile, where one is made, is paid here
    events: dict[str, list[Any]] = {name: [] for name in passes}
    shaped: list[Any] = []
    for _ in range(args.repeats):  # each profile reduced as soon as it is taken: a gate's holds ~10^5 events
        for name, run in passes.items():
            prof = profiled(run)
            events[name] += prof.key_averages()
            if name == "gate":
                shaped += prof.key_averages(group_by_input_shape=True)
            del prof
    ops = {name: per_pass(ev, args.repeats) for name, ev in events.items()}
    table = operator_table(ops["gate"], ops["forward"], args.top)
    shapes = per_pass(shaped, args.repeats, by_shape=True)
    result = {
        "model": f"Qwen3-MoE, {LAYERS} routed layers x {EXPERTS} experts, k = {TOP_K}, width {args.width}, float32",
        "canary": f"{WINDOWS} x 128 tokens, micro-batches of {cfg.receipts.batch_windows} windows",
        "torch_threads": 1, "repeats": args.repeats, "kernels": args.kernels,
        "kernels_taken": sorted({lay["selfcheck"]["kernels"] for lay in warm["gate"].layers}),
        "kernels_fallback": PROCESS_KERNELS.fallback,
        "self_ms_total": {name: round(sum(ms for _, ms in o.values()), 1) for name, o in ops.items()},
        "calls_total": {name: round(sum(c for c, _ in o.values())) for name, o in ops.items()},
        "operators": table,
        "shapes": {row["operator"]: costliest_shapes(shapes, row["operator"])
                   for row in table[: args.shapes]},
    }
    write_result(result, args.out or HERE / f"gate_ops_w{args.width}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
