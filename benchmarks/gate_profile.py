"""Gate / plain forward at many routed layers and experts, and where a gate's time goes.

``python benchmarks/gate_profile.py`` writes ``benchmarks/gate_profile.json``: CPU seconds of a plain no-grad
forward over the canary, of a gate (fused mode, no baseline) and of a gate against a baseline (drift), their
ratios, and the functions a profiled gate spends most of its own time in (``cProfile``, seconds of the profiled
run: the profiler's overhead inflates them alike), for freshly initialised Qwen3-MoE models of width 64
(``--width``) with k = 8: 24 routed layers x 128 experts and 8 routed layers x 64 experts, each over a 32 x
128-token canary, with the gate's field arithmetic as ``--kernels`` chooses (``receipts.kernels``, default auto;
docs/receipts.md#field-kernels: a compile is paid in the warm-up). One process, one torch thread, passes
interleaved, the medians of ``--repeats``; ``over_plain_forward`` is the ratio of the medians,
``over_plain_forward_paired`` the median of each repeat's own ratio (a gate against the plain forward run next to
it, which a host whose speed drifts during the run moves less) and ``over_plain_forward_paired_spread`` the
smallest and largest of those ratios; ``kernels_taken`` the paths the routed layers' field arithmetic took (and
``kernels_fallback`` why it is eager, where a compile failed). Results in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
from pathlib import Path
from typing import Any

import torch

from atlas_tracking import AtlasConfig, Baseline, measure
from atlas_tracking.engine.kernels import PROCESS_KERNELS
from atlas_tracking.testing.bench import cpu_seconds, gate_bench_inputs, plain_forward, write_result

HERE = Path(__file__).resolve().parent
SHAPES = {
    "24 layers x 128 experts": dict(layers=24, experts=128),
    "8 layers x 64 experts": dict(layers=8, experts=64),
}
WIDTH, TOP_K, WINDOWS = 64, 8, 32
KERNELS = ("auto", "compiled", "eager")
"""The values of ``receipts.kernels``."""


def top_costs(run: Any, n: int) -> list[tuple[str, int, float]]:
    """The ``n`` functions with the most own time in one profiled ``run()``: (function, calls, seconds)."""
    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = [(f"{Path(file).name}:{line}({name})" if line else name, calls, own)
            for (file, line, name), (_, calls, own, _, _) in stats.items()]
    return [(name, calls, round(own, 4)) for name, calls, own in sorted(rows, key=lambda r: -r[2])[:n]]


def one_shape(layers: int, experts: int, repeats: int, profile_top: int, width: int = WIDTH,
              kernels: str = "auto") -> dict[str, Any]:
    model, canary = gate_bench_inputs(width, layers, experts, TOP_K, WINDOWS)
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "kernels": kernels}})
    base = Baseline.from_report(measure(model, canary, config=cfg))
    passes = {
        "plain": lambda: plain_forward(model, canary, cfg.receipts.batch_windows),
        "gate": lambda: measure(model, canary, config=cfg, keep_anchors=False),
        "gate_with_drift": lambda: measure(model, canary, baseline=base, config=cfg, keep_anchors=False),
    }
    warm = {name: run() for name, run in passes.items()}  # warm-up (a compile included)
    times = cpu_seconds(passes, repeats)
    med = {name: statistics.median(t) for name, t in times.items()}
    paired = {name: [g / p for g, p in zip(times[name], times["plain"])] for name in ("gate", "gate_with_drift")}
    return {
        "cpu_seconds_median": med,
        "over_plain_forward": {name: med[name] / med["plain"] for name in ("gate", "gate_with_drift")},
        "over_plain_forward_paired": {name: statistics.median(r) for name, r in paired.items()},
        "over_plain_forward_paired_spread": {name: [min(r), max(r)] for name, r in paired.items()},
        "kernels_taken": sorted({lay["selfcheck"]["kernels"] for lay in warm["gate"].layers}),
        "kernels_fallback": PROCESS_KERNELS.fallback,
        "gate_top_costs": top_costs(passes["gate"], profile_top),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile-top", type=int, default=15, help="functions listed from the profiled gate")
    ap.add_argument("--width", type=int, default=WIDTH, help="the models' width")
    ap.add_argument("--kernels", choices=KERNELS, default="auto",
                    help="receipts.kernels: how the gate's field arithmetic runs (docs/receipts.md#field-kernels)")
    ap.add_argument("--out", default=str(HERE / "gate_profile.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result: dict[str, Any] = {"torch_threads": 1, "repeats": args.repeats, "width": args.width, "top_k": TOP_K,
                              "kernels": args.kernels, "canary_windows": WINDOWS, "shapes": {}}
    for name, shape in SHAPES.items():
        result["shapes"][name] = one_shape(**shape, repeats=args.repeats, profile_top=args.profile_top,
                                           width=args.width, kernels=args.kernels)
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
