"""Parameter drift, measured: the time it adds to a gate (the reference copy and the measurement).

``python benchmarks/param_drift.py`` writes ``benchmarks/param_drift.json`` and prints it. The model is
the demo's Qwen3-MoE (``atlas_tracking.testing.lightning_lm.build_qwen3_moe``: 1.65M parameters, 4 routed layers,
E=32, k=2, random init) and the canary the demo's (64 windows x 128 tokens). Times are one process, one
torch thread, ``--repeats`` passes, CPU seconds of the process (``time.process_time``: on a shared machine
wall time carries the others' load); the ratio is of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from atlas_tracking import AtlasConfig, Baseline, measure
from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.engine.param_reference import ParamReference
from atlas_tracking.testing.bench import write_result
from atlas_tracking.testing.demo import demo_canary
from atlas_tracking.testing.lightning_lm import build_qwen3_moe

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--out", default=str(HERE / "param_drift.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = build_qwen3_moe(seed=0).eval()
    layers = find_routed_layers(model)
    canary = demo_canary()
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "anchors": 512}})
    baseline = Baseline.from_report(measure(model, canary, config=cfg))
    ref = ParamReference()
    times: dict[str, list[float]] = {"gate": [], "reference_copy": [], "param_drift_measure": []}
    for _ in range(args.repeats):
        t0 = time.process_time()
        measure(model, canary, baseline=baseline, config=cfg)
        t1 = time.process_time()
        ref.take(model, layers, step=0)
        t2 = time.process_time()
        ref.measure(model)
        t3 = time.process_time()
        for name, t in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
            times[name].append(t)
    med = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "model": "demo Qwen3-MoE (d=64, 4 routed layers, E=32, k=2, vocabulary 256), random init",
        "parameters": sum(p.numel() for p in model.parameters()),
        "host_bytes_of_the_reference": ref.host_bytes,
        "cpu_seconds_median": med,
        "ratio_param_drift_over_gate": (med["reference_copy"] + med["param_drift_measure"]) / med["gate"],
        "cpu_seconds_all": times,
        "torch_threads": 1,
        "repeats": args.repeats,
    }
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
