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

from typing import Any

import numpy as np
import torch

from atlas_tracking.artifacts.gate_report import GateReport
from atlas_tracking.artifacts.io import jsonable
from atlas_tracking.engine.canary import Canary
from atlas_tracking.engine.measure import _model_device, default_forward
from atlas_tracking.receipts.kl import window_kl_exact
from atlas_tracking.receipts.stats import bootstrap_indices, ratio, ratio_ci

DRIFT_KIND = "atlas-drift"


def exact_kl(base: Any, candidate: Any, canary: Canary, batch_windows: int) -> dict[str, Any]:
    """Per-window sums and counts of the full-vocabulary KL(base || candidate) over the canary's
    predicted tokens (both models' no-grad eval forward, one micro-batch of windows at a time)."""

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






