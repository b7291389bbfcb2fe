"""What router-expert coupling costs a gate (docs/receipts.md#router-expert-coupling), as a ratio in one process.

``python benchmarks/coupling_cost.py`` writes ``benchmarks/coupling_cost.json``: CPU seconds of a gate (fused mode, no
baseline) and of a gate against a baseline, each run as it ships and with the coupling work taken out (the capture's
per-micro-batch sums, ``engine.capture.LayerCapture._add_coupling`` and ``receipts.coupling.field_sum``/``window_sums``,
and the host's ``alignment_receipts_of`` replaced by no-ops for that pass only), for a freshly initialised Qwen3-MoE of
width 64 (``--width``) with k = 8, 24 routed layers x 128 experts, over a 32 x 128-token canary (as ``benchmarks/gate_profile.py``).
One torch thread, the four passes interleaved, the medians of ``--repeats``; ``overhead`` is the ratio of the medians
minus 1, ``overhead_paired`` the median of each repeat's own ratio minus 1.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import atlas_tracking.engine.capture as capture
import atlas_tracking.receipts.windows as windows
from atlas_tracking import AtlasConfig, Baseline, Canary, measure
from atlas_tracking.testing.bench import cpu_seconds, write_result
from atlas_tracking.testing.demo import demo_canary
from atlas_tracking.testing.lightning_lm import build_qwen3_moe

HERE = Path(__file__).resolve().parent
LAYERS, EXPERTS, WIDTH, TOP_K, WINDOWS, WINDOW = 24, 128, 64, 8, 32, 128


@contextlib.contextmanager
def without_coupling() -> Iterator[None]:
    """The gate with its coupling work replaced by no-ops (for the comparison pass only)."""
    saved = (capture.LayerCapture._unit_rows, windows.alignment_receipts_of)
    capture.LayerCapture._unit_rows = lambda self, device: None  # no rows: no sums in the capture
    windows.alignment_receipts_of = lambda entries, *args: [({}, {})] * len(entries)
    try:
        yield
    finally:
        capture.LayerCapture._unit_rows, windows.alignment_receipts_of = saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--width", type=int, default=WIDTH, help="the model's width (64: the shape of the gate's profile)")
    ap.add_argument("--out", default=str(HERE / "coupling_cost.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = build_qwen3_moe(seed=0, hidden=args.width, layers=LAYERS, experts=EXPERTS, top_k=TOP_K, aux_coef=0.0).eval()
    canary = Canary.from_token_ids(demo_canary().windows.reshape(-1), window=WINDOW, n_windows=WINDOWS, seed=0)
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False}})
    baseline = Baseline.from_report(measure(model, canary, config=cfg))

    def gate(base: Any = None, coupling: bool = True) -> None:
        with contextlib.nullcontext() if coupling else without_coupling():
            measure(model, canary, baseline=base, config=cfg, keep_anchors=False)

    passes = {
        "gate": lambda: gate(),
        "gate_without_coupling": lambda: gate(coupling=False),
        "gate_with_drift": lambda: gate(baseline),
        "gate_with_drift_without_coupling": lambda: gate(baseline, coupling=False),
    }
    for run in passes.values():  # warm-up
        run()
    times = cpu_seconds(passes, args.repeats)
    med = {name: statistics.median(t) for name, t in times.items()}
    pairs = {"gate": "gate_without_coupling", "gate_with_drift": "gate_with_drift_without_coupling"}
    result: dict[str, Any] = {
        "torch_threads": 1, "repeats": args.repeats, "layers": LAYERS, "experts": EXPERTS, "width": args.width,
        "top_k": TOP_K, "canary_windows": WINDOWS, "window": WINDOW, "cpu_seconds_median": med,
        "overhead": {on: med[on] / med[off] - 1.0 for on, off in pairs.items()},
        "overhead_paired": {on: statistics.median(a / b for a, b in zip(times[on], times[off])) - 1.0
                            for on, off in pairs.items()},
    }
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
