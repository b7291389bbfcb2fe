"""A gate's cost before and after a change, in one process: the package at an earlier commit, imported under another
name, beside the working tree's, and a plain forward, interleaved.

``python benchmarks/gate_before_after.py --before 18a8d7f --width 64`` writes ``benchmarks/gate_before_after.json``:
for a freshly initialised Qwen3-MoE (24 routed layers x 128 experts, k = 8, float32, ``--width`` wide) over a
32 x 128-token canary in micro-batches of 8 windows, the CPU seconds of a plain no-grad forward, of the earlier
commit's gate and of this tree's gate with each field-kernel path asked for (``--kernels``, docs/receipts.md#field-kernels),
without a baseline; their medians over ``--repeats``, each gate's ratio to the plain forward (the ratio of the medians,
the median of each repeat's own ratio and its spread), the host reads of one gate of each (``testing/host_reads.py``)
and the receipts' largest difference between the two commits. One torch thread.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atlas_tracking import AtlasConfig, measure
from atlas_tracking.testing.bench import (
    cpu_seconds,
    gate_bench_inputs,
    import_renamed,
    plain_forward,
    renamed_package_at,
    write_result,
)
from atlas_tracking.testing.demo import demo_canary
from atlas_tracking.testing.host_reads import host_reads

HERE = Path(__file__).resolve().parent
LAYERS, EXPERTS, TOP_K, WINDOWS = 24, 128, 8, 32


def receipts_gap(a: Any, b: Any) -> float:
    """The largest absolute difference between two reports' per-layer receipts (numbers present in both)."""
    gap = 0.0
    for la, lb in zip(a.layers, b.layers):
        for key, va in la["receipts"].items():
            vb = lb["receipts"].get(key)
            if isinstance(va, float) and isinstance(vb, float) and np.isfinite(va) and np.isfinite(vb):
                gap = max(gap, abs(va - vb))
    return gap


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the earlier commit")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--kernels", nargs="+", default=["eager"], choices=["eager", "compiled"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(HERE / "gate_before_after.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    old = import_renamed(renamed_package_at(args.before, Path(tempfile.mkdtemp()), HERE.parent))
    model, canary = gate_bench_inputs(args.width, LAYERS, EXPERTS, TOP_K, WINDOWS)
    old_canary = old.Canary.from_token_ids(demo_canary().windows.reshape(-1), window=128, n_windows=WINDOWS, seed=0)
    old_cfg = old.AtlasConfig.from_dict({"receipts": {"progress": False}})
    cfgs = {k: AtlasConfig.from_dict({"receipts": {"progress": False, "kernels": k}}) for k in args.kernels}
    passes = {
        "plain": lambda: plain_forward(model, canary, 8),
        "before": lambda: old.measure(model, old_canary, config=old_cfg, keep_anchors=False),
        **{f"after_{k}": (lambda c=c: measure(model, canary, config=c, keep_anchors=False)) for k, c in cfgs.items()},
    }
    reports = {name: run() for name, run in passes.items()}  # the warm-up (and the compile)
    reads = {}
    for name, run in passes.items():
        with host_reads() as counted:
            run()
        reads[name] = counted.total
    times = cpu_seconds(passes, args.repeats)
    med = {name: statistics.median(t) for name, t in times.items()}
    gates = [name for name in passes if name != "plain"]
    paired = {g: [a / p for a, p in zip(times[g], times["plain"])] for g in gates}
    write_result({
        "before": args.before, "width": args.width, "layers": LAYERS, "experts": EXPERTS, "top_k": TOP_K,
        "canary_windows": WINDOWS, "repeats": args.repeats, "torch_threads": 1,
        "cpu_seconds_median": med,
        "over_plain_forward": {g: med[g] / med["plain"] for g in gates},
        "over_plain_forward_paired": {g: statistics.median(paired[g]) for g in gates},
        "over_plain_forward_paired_spread": {g: [min(paired[g]), max(paired[g])] for g in gates},
        "after_over_before_paired": {g: statistics.median(a / b for a, b in zip(times[g], times["before"]))
                                     for g in gates if g != "before"},
        "host_reads_per_pass": reads,
        "kernels_taken": {g: sorted({lay["selfcheck"].get("kernels", "eager") for lay in reports[g].layers})
                          for g in gates if g != "before"},
        "largest_receipt_difference_from_before": {g: receipts_gap(reports["before"], reports[g])
                                                   for g in gates if g != "before"},
    }, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
