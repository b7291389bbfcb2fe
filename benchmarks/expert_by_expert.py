"""A gate with its experts' products expert by expert against grouped products, in one process.

``python benchmarks/expert_by_expert.py --widths 64 128 256`` writes ``benchmarks/expert_by_expert.json``: for a
freshly initialised Qwen3-MoE (24 routed layers x 128 experts, k = 8, float32) of each width over a 32 x 128-token
canary in micro-batches of 8 windows, the CPU seconds of a plain no-grad forward and of a gate (no baseline, eager
field arithmetic) whose competitors' products run expert by expert right after each expert's active ones
(``adapters/grouped_experts.py``, ``INTERLEAVE_BYTES`` 0) and of one whose products run as grouped products, one
pass for the active rows and one for the competitors (``INTERLEAVE_BYTES`` above every expert's weights); the passes
interleaved, the median of each repeat's gate / forward ratio and its spread. The receipts are the same either way
(the products' bits are), which the run checks. One torch thread. Results in ``benchmarks/RESULTS.md`` (u): they
set ``INTERLEAVE_BYTES``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

from atlas_tracking import AtlasConfig, measure
from atlas_tracking.adapters import grouped_experts
from atlas_tracking.testing.bench import cpu_seconds, gate_bench_inputs, plain_forward, write_result

HERE = Path(__file__).resolve().parent
LAYERS, EXPERTS, TOP_K, WINDOWS, BATCH = 24, 128, 8, 32, 8
WAYS = {"expert_by_expert": 0, "grouped": 1 << 62}
"""``INTERLEAVE_BYTES`` for each way."""


def one_width(width: int, repeats: int) -> dict[str, Any]:
    model, canary = gate_bench_inputs(width, LAYERS, EXPERTS, TOP_K, WINDOWS)
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "kernels": "eager", "batch_windows": BATCH}})

    def gate(threshold: int) -> Any:
        grouped_experts.INTERLEAVE_BYTES = threshold
        return measure(model, canary, config=cfg, keep_anchors=False)

    passes = {"plain": lambda: plain_forward(model, canary, BATCH),
              **{way: (lambda t=threshold: gate(t)) for way, threshold in WAYS.items()}}
    default = grouped_experts.INTERLEAVE_BYTES
    try:
        reports = {way: passes[way]() for way in WAYS}  # the warm-up
        plain_forward(model, canary, BATCH)
        times = cpu_seconds(passes, repeats)
    finally:
        grouped_experts.INTERLEAVE_BYTES = default
    same = all(a["receipts"] == b["receipts"] for a, b in zip(*(r.layers for r in reports.values())))
    paired = {way: [g / p for g, p in zip(times[way], times["plain"])] for way in WAYS}
    return {"plain_seconds": statistics.median(times["plain"]),
            "gate_seconds": {way: statistics.median(times[way]) for way in WAYS},
            "gate_over_plain_paired": {way: statistics.median(r) for way, r in paired.items()},
            "gate_over_plain_paired_spread": {way: [min(r), max(r)] for way, r in paired.items()},
            "expert_weights_kib": {name: getattr(model.model.layers[0].mlp.experts, name)[0].numel() * 4 / 1024
                                   for name in ("gate_up_proj", "down_proj")},
            "same_receipts": same}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "expert_by_expert.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    write_result({"layers": LAYERS, "experts": EXPERTS, "top_k": TOP_K, "canary_windows": WINDOWS,
                  "batch_windows": BATCH, "repeats": args.repeats, "torch_threads": 1,
                  "widths": {str(w): one_width(w, args.repeats) for w in args.widths}}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
