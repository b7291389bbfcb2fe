"""The report's router-expert coupling section, from a real gate's record (docs/receipts.md#router-expert-coupling)."""

from __future__ import annotations

import numpy as np

from atlas_tracking import Baseline, Canary, measure
from atlas_tracking.artifacts.record import gate_record
from atlas_tracking.testing.families import CFG, family_model
from atlas_tracking.viz.coupling import alignment_grid, coupling_section
from atlas_tracking.viz.html_report import run_page

CANARY = Canary.from_token_ids(np.arange(600) * 7 % 64, window=16, n_windows=4, seed=0)


def test_the_picture_holds_each_experts_alignment_beside_its_load():
    model = family_model("deepseek_v3")
    base = Baseline.from_report(measure(model, CANARY, config=CFG))
    report = measure(model, CANARY, baseline=base, config=CFG)
    rec = gate_record(report, None, step=5, loss=1.0)
    labels, grid = alignment_grid(rec["layers"])
    assert len(labels) == len(report.layers)
    for row, layer in zip(grid, report.layers):
        want = [np.nan if a is None else a for a in layer["receipts"]["alignment"]]
        np.testing.assert_array_equal(row, want)  # a dead expert stays blank
    text, figures = coupling_section(rec, lambda png, alt: f"[{alt}]")
    assert list(figures) == ["alignment.png"] and figures["alignment.png"].startswith(b"\x89PNG")
    assert "[expert load and router-row alignment: layers x experts]" in text
    assert f"<td>{rec['layers'][0]['alignment_median']:.3f}</td>" in text
    page, page_figures = run_page([rec], "run")
    assert "Router-expert coupling (last gate)" in page and "alignment.png" in page_figures


def test_a_gate_without_alignment_says_why():
    text, figures = coupling_section({"step": 1, "layers": [{"index": 0, "alignment_absent": "no rows"}]}, str)
    assert figures == {} and "No alignment: no rows" in text
