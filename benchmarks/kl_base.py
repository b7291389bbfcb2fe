"""kl_base, measured: the baseline's growth and a gate's time with and without the base top-K.

``python benchmarks/kl_base.py`` writes ``benchmarks/kl_base.json`` and prints it. The model is the
demo's Qwen3-MoE (``atlas_tracking.testing.lightning_lm.build_qwen3_moe``: d=64, 4 routed layers, E=32, k=2,
byte vocabulary 256, random init: neither the sizes nor the times depend on training) and the
canary the demo's (64 windows x 128 tokens of held-out prose, 8128 predicted tokens). Times are
one process, one torch thread, passes interleaved, ``--repeats`` of each, as CPU seconds of the
process (``time.process_time``: on a machine shared with other work, wall time carries their load);
the ratio is of the medians, the fastest passes are kept beside them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from atlas_tracking import AtlasConfig, Baseline, measure
from atlas_tracking.testing.bench import cpu_seconds, write_result
from atlas_tracking.testing.demo import demo_canary
from atlas_tracking.testing.lightning_lm import build_qwen3_moe

HERE = Path(__file__).resolve().parent


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--out", default=str(HERE / "kl_base.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = build_qwen3_moe(seed=0).eval()
    canary = demo_canary()
    cfgs = {k: AtlasConfig.from_dict({"receipts": {"progress": False, "anchors": 512, "kl_top_k": k}}) for k in (0, 32)}
    tmp = Path(tempfile.mkdtemp())
    baselines, sizes = {}, {}
    for k, cfg in cfgs.items():
        baselines[k] = Baseline.from_report(measure(model, canary, config=cfg))
        sizes[k] = _size(baselines[k].save(tmp / f"k{k}"))
    times = cpu_seconds({
        "gate_with_baseline_no_kl": lambda: measure(model, canary, baseline=baselines[0], config=cfgs[0]),
        "gate_with_baseline_kl_top_k_32": lambda: measure(model, canary, baseline=baselines[32], config=cfgs[32]),
    }, args.repeats)
    med = {name: statistics.median(t) for name, t in times.items()}
    best = {name: min(t) for name, t in times.items()}
    tokens = canary.n_windows * (canary.window - 1)
    result = {
        "model": "demo Qwen3-MoE (d=64, 4 routed layers, E=32, k=2, vocabulary 256), random init",
        "canary": {"n_windows": canary.n_windows, "window": canary.window, "predicted_tokens": tokens},
        "baseline_bytes": {"kl_top_k_0": sizes[0], "kl_top_k_32": sizes[32], "growth": sizes[32] - sizes[0],
                           "growth_per_predicted_token": (sizes[32] - sizes[0]) / tokens},
        "gate_cpu_seconds_median": med,
        "gate_cpu_seconds_min": best,
        "gate_cpu_seconds_all": times,
        "ratio_kl_over_no_kl": med["gate_with_baseline_kl_top_k_32"] / med["gate_with_baseline_no_kl"],
        "torch_threads": 1,
        "repeats": args.repeats,
    }
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
