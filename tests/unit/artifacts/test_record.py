"""The gate record: units that cannot be misread, and tracker metrics."""

from __future__ import annotations

from atlas_tracking.artifacts.record import gate_metrics
from atlas_tracking.viz.tables import summary_line


def test_cv_units_are_unambiguous():
    """Summary mean/max CV are percentages (the policy's unit), per-layer load_cv a fraction: names say which."""
    rec = {"step": 1, "c2": 0.1, "dead_experts": 0.0, "min_entropy": 2.0, "mean_cv": 45.0, "max_cv": 60.0,
           "layers": [{"ordinal": 0, "load_cv": 0.45}, {"ordinal": 1, "load_cv": 0.30}]}
    metrics = gate_metrics(rec)
    assert "atlas/mean_cv" not in metrics and "atlas/max_cv" not in metrics
    assert metrics["atlas/mean_cv_pct"] == 45.0 and metrics["atlas/max_cv_pct"] == 60.0
    assert metrics["atlas/layer_00/load_cv"] == 0.45
    assert "cv%=45.0" in summary_line(rec)
