"""``atlas-tracking compare``: drift between two checkpoints on one canary (the lineage comparison).

The base checkpoint is measured first and becomes the baseline; the candidate is then measured
against it. ``drift.json`` holds a ``layers`` list (coordinate, boundary, transition and content
drift per layer, with CIs and paired deltas) and the top-level ``handoff_margin`` and
``refine_margin``, and ``kl_base``: the bounded KL(base || candidate) every gate reports
(from the base's top-K log-probabilities) beside the exact full-vocabulary KL, each per
window and overall with a window-bootstrap CI. The exact KL needs both models' full logits:
the base checkpoint is loaded a second time beside the candidate (``--no-exact-kl`` skips it
when two models do not fit).
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atlas_tracking.baseline import Baseline, reference_from_report
from atlas_tracking.canary import Canary
from atlas_tracking.config import AtlasConfig
from atlas_tracking.gate_report import GateReport, jsonable, read_artifact, write_atomic
from atlas_tracking.receipts.kl import window_kl_exact
from atlas_tracking.receipts.stats import bootstrap_indices, ratio, ratio_ci
from atlas_tracking.tables import format_table

DRIFT_KIND = "atlas-drift"
DRIFT_COLUMNS = ("coord_drift", "boundary_drift", "transition_drift", "content_drift", "c2_delta", "dead_experts_delta")


def exact_kl(base: Any, candidate: Any, canary: Canary, batch_windows: int) -> dict[str, Any]:
    """Per-window sums and counts of the full-vocabulary KL(base || candidate) over the canary's
    predicted tokens (both models' no-grad eval forward, one micro-batch of windows at a time)."""
    from atlas_tracking.measure import _model_device, default_forward

    sums, counts = np.zeros(canary.n_windows), np.zeros(canary.n_windows, dtype=np.int64)
    modes = [(m, m.training) for m in (base, candidate)]
    try:
        for m, _ in modes:
            m.eval()
        with torch.no_grad():
            for start, end in canary.batches(batch_windows):
                ids = torch.from_numpy(canary.windows[start:end])
                p = default_forward(base, ids.to(_model_device(base)))
                q = default_forward(candidate, ids.to(_model_device(candidate)))
                s, c = window_kl_exact(p.to(q.device), q)
                sums[start:end], counts[start:end] = s.cpu().numpy(), c.cpu().numpy()
    finally:
        for m, was in modes:
            m.train(was)
    return {"sum": sums, "count": counts}


def kl_section(report: GateReport, exact: dict[str, Any] | None, why_not_exact: str | None) -> dict[str, Any]:
    """Bounded and exact KL(base || candidate): overall with a window-bootstrap CI, and per window."""
    rcfg = report.config["receipts"]
    idx = bootstrap_indices(report.canary["n_windows"], rcfg["n_bootstrap"], rcfg["seed"])

    def side(pw: dict[str, Any] | None) -> dict[str, Any] | None:
        if pw is None:
            return None
        s, c = np.asarray(pw["sum"], float), np.asarray(pw["count"], float)
        return {"value": ratio(s, c), "ci": list(ratio_ci(s, c, idx, rcfg["ci_level"])),
                "per_window": np.divide(s, c, out=np.full_like(s, np.nan), where=c > 0)}

    return {"bounded": side(report.per_window.get("kl_base")), "exact": side(exact),
            "bounded_absent": (report.drift or {}).get("kl_base_absent"), "exact_absent": why_not_exact}


def kl_line(kl: dict[str, Any]) -> str:
    """One line: the bounded and the exact KL(base || candidate), or why either is missing."""
    def show(name: str) -> str:
        v = kl[name]
        if v is None:
            return f"{name}: not computed ({kl[name + '_absent']})"
        return f"{name}={v['value']:.6g} [{v['ci'][0]:.4g}, {v['ci'][1]:.4g}]"

    return f"KL(base || candidate) per predicted token, nats: {show('bounded')}  {show('exact')}"


def drift_document(report: GateReport, base_dir: str, candidate_dir: str,
                   kl: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``drift.json`` payload: per-layer drift, the two lifecycle margins, and the KL to the base."""
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
            "canary_nll_delta": drift.get("canary_nll_delta"),
            "canary_nll_delta_ci": drift.get("canary_nll_delta_ci"),
            "kl_base": kl,
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
    from atlas_tracking.cli import add_model_options

    p = sub.add_parser("compare", help="drift between two transformers checkpoints on one canary")
    p.add_argument("--base", required=True, help="base checkpoint directory")
    p.add_argument("--candidate", required=True, help="candidate checkpoint directory")
    p.add_argument("--canary", required=True, help=".npy or .npz canary")
    p.add_argument("--out", required=True, help="drift JSON to write")
    p.add_argument("--reference", help="receipts JSON of a healthy reference for the handoff margin (default: base)")
    p.add_argument("--save-baseline", help="also save the base checkpoint's baseline directory here")
    p.add_argument("--no-exact-kl", action="store_true",
                   help="skip the exact full-vocabulary KL (it loads the base checkpoint again beside the candidate)")
    add_model_options(p)
    p.set_defaults(func=cmd_compare)
