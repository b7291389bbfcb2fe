"""The post-training base, measured: a gate's time after a resume, when it also reads the base.

After a resume the baseline is the resume gate, and the gate reads a second reference in the same forward: the
KL against the base's top-K log-probabilities and the drift of the refinement margin against the base's anchors
(docs/receipts.md#since-the-base). ``python benchmarks/post_training_base.py`` writes
``benchmarks/post_training_base.json`` and prints it: a gate's CPU seconds against the baseline alone, and against
the baseline and a base that is another checkpoint. The model is the demo's Qwen3-MoE
(``atlas_tracking.testing.lightning_lm.build_qwen3_moe``: d=64, 4 routed layers, E=32, k=2, byte vocabulary 256,
random init, weights moved between the three checkpoints) and the canary the demo's (64 windows x 128 tokens,
512 anchors). One process, one torch thread, passes interleaved, ``--repeats`` of each, as CPU seconds of the
process (``time.process_time``); the ratio is of the medians.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from atlas_tracking import AtlasConfig, Baseline, measure
from atlas_tracking.testing.bench import cpu_seconds, write_result
from atlas_tracking.testing.demo import demo_canary
from atlas_tracking.testing.lightning_lm import build_qwen3_moe

HERE = Path(__file__).resolve().parent


def _moved(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--out", default=str(HERE / "post_training_base.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "anchors": 512}})
    canary = demo_canary()
    model = build_qwen3_moe(seed=0).eval()
    base = Baseline.from_report(measure(model, canary, config=cfg, step=0))
    baseline = Baseline.from_report(measure(_moved(model, 1), canary, config=cfg, step=100))
    _moved(model, 2)
    times = cpu_seconds({
        "baseline_only": lambda: measure(model, canary, config=cfg, step=200, baseline=baseline),
        "baseline_and_base": lambda: measure(model, canary, config=cfg, step=200, baseline=baseline, base=base),
    }, args.repeats)
    med = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "model": "demo Qwen3-MoE (d=64, 4 routed layers, E=32, k=2, vocabulary 256), random init, moved",
        "canary": {"n_windows": canary.n_windows, "window": canary.window, "anchors": 512},
        "gate_cpu_seconds_median": med,
        "gate_cpu_seconds_min": {name: min(t) for name, t in times.items()},
        "ratio_with_base_over_baseline_only": med["baseline_and_base"] / med["baseline_only"],
        "torch_threads": 1,
        "repeats": args.repeats,
    }
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
