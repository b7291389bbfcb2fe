"""What a gate computes on the host after its one read-back, before and after a change, in one process.

``python benchmarks/host_report.py --before 93c3f7a`` writes ``benchmarks/host_report.json``: for the gate
benchmarks' model (a freshly initialised Qwen3-MoE, ``--layers`` routed layers x 128 experts, k = 8, ``--width``
wide) and 32 x 128-token canary (``--canary WxL``: random tokens in W windows of L), each package (this tree's, and
with ``--before`` the package at that commit, imported under another name) measures one gate's partial on the device
side once (``measure_partial``), then builds the report from it (``build_report``: merging, the self-check's
summary, the window bootstrap of every receipt) and, for a gate against a baseline of the same weights, derives its
drift (``attach_drift``: drift functionals, paired deltas, lifecycle margins), the packages' passes interleaved; CPU
seconds, the medians of ``--repeats``, also per routed layer, and whether the two packages' reports and drift
sections are the same JSON. This part of a gate does not depend on the device the gate ran on. One torch thread, one
BLAS thread (as a gate's derivation runs).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

import atlas_tracking
from atlas_tracking.testing.bench import (
    cpu_seconds,
    gate_bench_inputs,
    import_renamed,
    renamed_package_at,
    write_result,
)

HERE = Path(__file__).resolve().parent
EXPERTS, TOP_K, WINDOWS = 128, 8, 32


def host_passes(package: ModuleType, model: torch.nn.Module, canary_ids: np.ndarray, windows: int, window: int
                ) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
    """``package``'s two host passes over one gate of ``model`` (``report`` and ``drift``) and what each gives, as JSON
    (the report, and the drift section of a gate against a baseline of the same weights), a renamed package's name
    read as ``atlas_tracking``."""
    engine = importlib.import_module(package.__name__ + ".engine.measure")
    find = importlib.import_module(package.__name__ + ".adapters.base").find_routed_layers
    plan_of = importlib.import_module(package.__name__ + ".engine.anchors").AnchorPlan.select
    canary = package.Canary.from_token_ids(canary_ids, window=window, n_windows=windows, seed=0)
    cfg = package.AtlasConfig.from_dict({"receipts": {"progress": False}})
    layers = find(model)
    plan = plan_of(canary, cfg.receipts.anchors, cfg.receipts.seed)
    partial = engine.measure_partial(model, canary, cfg, layers, 0, 1, anchors=plan, collect=False)
    folder = Path(tempfile.mkdtemp()) / "baseline"
    package.Baseline.from_report(package.measure(model, canary, config=cfg)).save(folder)
    baseline = package.Baseline.load(folder)
    gate = package.measure(model, canary, baseline=baseline, config=cfg)
    passes = {"report": lambda: engine.build_report([partial], layers, canary, cfg, model, 0, plan, None),
              "drift": lambda: engine.attach_drift(gate, baseline, None, None)}
    outputs = {"report": passes["report"]().to_json()}
    passes["drift"]()
    outputs["drift"] = json.dumps(gate.drift)
    return passes, {part: text.replace(package.__name__, "atlas_tracking") for part, text in outputs.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=None, help="an earlier commit, measured beside this tree")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--canary", default=None, metavar="WxL",
                    help="a canary of W windows of L tokens drawn at random (seed 0) instead of the benchmarks' "
                         "32 x 128 of the demo text: the host part grows with the windows and the boundary tokens")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=str(HERE / "host_report.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, canary = gate_bench_inputs(args.width, args.layers, EXPERTS, TOP_K, WINDOWS)
    windows, window = (int(n) for n in args.canary.split("x")) if args.canary else (WINDOWS, 128)
    ids = (np.random.default_rng(0).integers(0, model.config.vocab_size, windows * window) if args.canary
           else canary.windows.reshape(-1))
    # the model's rotary positions are computed, not looked up in a table: a longer context is the same model
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, window)
    packages = {"after": atlas_tracking}
    if args.before:
        packages = {"before": import_renamed(renamed_package_at(args.before, Path(tempfile.mkdtemp()), HERE.parent)),
                    **packages}
    passes, outputs = {}, {}
    for name, package in packages.items():
        own, outputs[name] = host_passes(package, model, ids, windows, window)
        passes.update({f"{name}_{part}": run for part, run in own.items()})
    times = cpu_seconds(passes, args.repeats)
    med = {name: statistics.median(t) for name, t in times.items()}
    result: dict[str, Any] = {
        "before": args.before, "width": args.width, "layers": args.layers, "experts": EXPERTS, "top_k": TOP_K,
        "canary": [windows, window], "repeats": args.repeats, "torch_threads": 1,
        "cpu_ms_median": {name: 1e3 * s for name, s in med.items()},
        "cpu_ms_per_layer": {name: 1e3 * s / args.layers for name, s in med.items()},
        "cpu_ms_spread": {name: [1e3 * min(t), 1e3 * max(t)] for name, t in times.items()},
    }
    if args.before:
        result["after_over_before"] = {part: med[f"after_{part}"] / med[f"before_{part}"] for part in outputs["after"]}
        result["same_json_as_before"] = {part: outputs["after"][part] == outputs["before"][part]
                                         for part in outputs["after"]}
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
