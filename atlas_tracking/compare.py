"""``atlas-tracking compare``: drift between two checkpoints on one canary (the lineage comparison).

The base checkpoint is measured first and becomes the baseline; the candidate is then measured
against it. ``drift.json`` holds a ``layers`` list (coordinate, boundary, transition and content
drift per layer, with CIs and paired deltas) and the top-level ``handoff_margin`` and
``refine_margin``.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

from atlas_tracking.baseline import Baseline, reference_from_report
from atlas_tracking.canary import Canary
from atlas_tracking.config import AtlasConfig
from atlas_tracking.gate_report import GateReport, jsonable, read_artifact, write_atomic
from atlas_tracking.tables import format_table

DRIFT_KIND = "atlas-drift"
DRIFT_COLUMNS = ("coord_drift", "boundary_drift", "transition_drift", "content_drift", "c2_delta", "dead_experts_delta")


def drift_document(report: GateReport, base_dir: str, candidate_dir: str) -> dict[str, Any]:
    """The ``drift.json`` payload: per-layer drift plus the two lifecycle margins."""
    drift = report.drift or {}
    layers = []
    for layer, d in zip(report.layers, drift["layers"]):
        layers.append({**d, "c2": layer["receipts"].get("c2"), "pi_min": layer["receipts"].get("pi_min")})
    return jsonable(
        {
            "schema_version": 1,
            "kind": DRIFT_KIND,
            "base": base_dir,
            "candidate": candidate_dir,
            "canary": report.canary,
            "layers": layers,
            "handoff_margin": drift["handoff_margin"],
            "handoff_layer": drift["handoff_layer"],
            "refine_margin": drift["refine_margin"],
            "refine_layer": drift["refine_layer"],
            "summary": report.summary,
        }
    )


def drift_table(doc: dict[str, Any]) -> str:
    rows = [[d["name"], "*" if d["protected"] else ""] + [d.get(k) for k in DRIFT_COLUMNS] for d in doc["layers"]]
    return format_table(["layer", "prot", *DRIFT_COLUMNS], rows)


def cmd_compare(args: argparse.Namespace) -> int:
    from atlas_tracking.cli import load_hf_model
    from atlas_tracking.measure import measure

    cfg = AtlasConfig.from_yaml(args.config) if args.config else AtlasConfig()
    cfg.receipts.progress = cfg.receipts.progress and not args.quiet
    canary = Canary.load(args.canary)
    reference = reference_from_report(read_artifact(args.reference)) if args.reference else None
    base_model = load_hf_model(args.base, args.dtype, args.device)
    baseline = Baseline.from_report(measure(base_model, canary, config=cfg))
    del base_model
    gc.collect()
    if args.save_baseline:
        baseline.save(args.save_baseline)
    candidate = load_hf_model(args.candidate, args.dtype, args.device)
    report = measure(candidate, canary, baseline=baseline, config=cfg, handoff_reference=reference)
    doc = drift_document(report, args.base, args.candidate)
    write_atomic(Path(args.out), json.dumps(doc, indent=1, allow_nan=False))
    print(drift_table(doc))
    print(
        f"handoff_margin={doc['handoff_margin']:+.4f} (binding {doc['handoff_layer']})  "
        f"refine_margin={doc['refine_margin']:+.4f} (binding {doc['refine_layer']})"
    )
    print(f"wrote {args.out}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from atlas_tracking.cli import add_model_options

    p = sub.add_parser("compare", help="drift between two transformers checkpoints on one canary")
    p.add_argument("--base", required=True, help="base checkpoint directory")
    p.add_argument("--candidate", required=True, help="candidate checkpoint directory")
    p.add_argument("--canary", required=True, help=".npy or .npz canary")
    p.add_argument("--out", required=True, help="drift JSON to write")
    p.add_argument("--reference", help="receipts JSON of a healthy reference for the handoff margin (default: base)")
    p.add_argument("--save-baseline", help="also save the base checkpoint's baseline directory here")
    add_model_options(p)
    p.set_defaults(func=cmd_compare)
