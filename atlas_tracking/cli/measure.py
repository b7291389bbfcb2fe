"""``atlas-tracking measure``: the receipts of a transformers checkpoint on a canary."""

from __future__ import annotations

import argparse
import time

from atlas_tracking.artifacts.baseline import Baseline
from atlas_tracking.cli.checkpoints import load_hf_model
from atlas_tracking.cli.common import add_model_options, load_config
from atlas_tracking.engine.canary import Canary
from atlas_tracking.engine.measure import measure
from atlas_tracking.viz.tables import layer_table, summary_line


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    cfg.receipts.progress = cfg.receipts.progress and not args.quiet
    canary = Canary.load(args.canary)
    model = load_hf_model(args.model, args.dtype, args.device)
    baseline = None
    if args.baseline:
        baseline = Baseline.load(args.baseline)
    t0 = time.perf_counter()
    keep = bool(args.save_baseline) or None
    report = measure(model, canary, baseline=baseline, config=cfg, step=args.step, keep_anchors=keep)
    elapsed = time.perf_counter() - t0
    report.save(args.out)
    if args.save_baseline:
        Baseline.from_report(report).save(args.save_baseline)
    print(layer_table(report.layers))
    damage = {k: v for k, v in (report.drift or {}).items() if k in ("kl_base", "canary_nll_delta")}
    print(summary_line({**report.summary, **damage}))
    if report.drift is not None and report.drift.get("kl_base_absent"):
        print(f"kl_base absent: {report.drift['kl_base_absent']}")
    print(f"wrote {args.out} ({len(report.layers)} routed layers, {canary.n_tokens} canary tokens, {elapsed:.2f}s)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("measure", help="measure atlas receipts of a transformers checkpoint on a canary")
    p.add_argument("--model", required=True, help="transformers checkpoint directory (safetensors)")
    p.add_argument("--canary", required=True, help=".npy [n_windows, window] token ids, or .npz from Canary.save")
    p.add_argument("--baseline", help="baseline directory (adds drift and paired deltas)")
    p.add_argument("--save-baseline", help="save this gate as a baseline directory")
    p.add_argument("--out", required=True, help="receipts artifact to write: .safetensors writes the binary form, "
                   "any other name JSON")
    p.add_argument("--step", type=int, default=None)
    add_model_options(p)
    p.set_defaults(func=run)
