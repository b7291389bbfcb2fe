"""``atlas-tracking compare``: drift between two checkpoints on one canary."""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.artifacts.baseline import Baseline
from atlas_tracking.artifacts.handoff_reference import HandoffReference
from atlas_tracking.artifacts.io import write_atomic
from atlas_tracking.cli.checkpoints import load_hf_model
from atlas_tracking.cli.common import add_model_options, load_config
from atlas_tracking.engine.canary import Canary
from atlas_tracking.engine.lineage import drift_document, exact_kl, kl_section
from atlas_tracking.engine.measure import check_references, measure
from atlas_tracking.schema.record import LAYER_DRIFT_FIELDS
from atlas_tracking.viz.tables import format_table


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    cfg.receipts.progress = cfg.receipts.progress and not args.quiet
    canary = Canary.load(args.canary)
    reference = HandoffReference.load(args.reference) if args.reference else None
    base_model = load_hf_model(args.base, args.dtype, args.device)
    check_references(base_model, canary, find_routed_layers(base_model), reference)  # before anything is measured
    baseline = Baseline.from_report(measure(base_model, canary, config=cfg))
    del base_model
    gc.collect()
    if args.save_baseline:
        baseline.save(args.save_baseline)
    candidate = load_hf_model(args.candidate, args.dtype, args.device)
    report = measure(candidate, canary, baseline=baseline, config=cfg, handoff_reference=reference)
    exact, why_not = None, "--no-exact-kl was given"
    if not args.no_exact_kl:
        base_model = load_hf_model(args.base, args.dtype, args.device)
        exact, why_not = exact_kl(base_model, candidate, canary, cfg.receipts.batch_windows), None
        del base_model
    doc = drift_document(report, args.base, args.candidate, kl_section(report, exact, why_not))
    write_atomic(Path(args.out), json.dumps(doc, indent=1, allow_nan=False))
    print(drift_table(doc))
    print(
        f"handoff_margin={doc['handoff_margin']:+.4f} (binding {doc['handoff_layer']})  "
        f"refine_margin={doc['refine_margin']:+.4f} (binding {doc['refine_layer']})"
    )
    print(kl_line(doc["kl_base"]))
    print(f"wrote {args.out}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="drift between two transformers checkpoints on one canary")
    p.add_argument("--base", required=True, help="base checkpoint directory")
    p.add_argument("--candidate", required=True, help="candidate checkpoint directory")
    p.add_argument("--canary", required=True, help=".npy or .npz canary")
    p.add_argument("--out", required=True, help="drift JSON to write")
    p.add_argument("--reference", help="receipts artifact (.json or .safetensors) or baseline directory of a healthy "
                   "reference for the handoff margin, measured on the same routed layers and canary (default: base)")
    p.add_argument("--save-baseline", help="also save the base checkpoint's baseline directory here")
    p.add_argument("--no-exact-kl", action="store_true",
                   help="skip the exact full-vocabulary KL (it loads the base checkpoint again beside the candidate)")
    add_model_options(p)
    p.set_defaults(func=run)


DRIFT_COLUMNS = LAYER_DRIFT_FIELDS


def kl_line(kl: dict[str, Any]) -> str:
    """One line: the bounded and the exact KL(base || candidate), or why either is missing."""
    def show(name: str) -> str:
        v = kl[name]
        if v is None:
            return f"{name}: not computed ({kl[name + '_absent']})"
        return f"{name}={v['value']:.6g} [{v['ci'][0]:.4g}, {v['ci'][1]:.4g}]"

    return f"KL(base || candidate) per predicted token, nats: {show('bounded')}  {show('exact')}"


def drift_table(doc: dict[str, Any]) -> str:
    rows = [[d["name"], "*" if d["protected"] else ""] + [d.get(k) for k in DRIFT_COLUMNS] for d in doc["layers"]]
    return format_table(["layer", "prot", *DRIFT_COLUMNS], rows)
