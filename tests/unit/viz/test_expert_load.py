"""The per-expert picture: the layers x experts share heatmap against a plain loop over a receipts artifact's
per-window loads, and a report that shows what the policy reads (occupancy axes, expert load, C2 change) for a
run whose dead-expert count stays 0 while its load CV rises."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from atlas_tracking.testing.browser import CHROMIUM
from atlas_tracking.viz.figures import expert_grids, fig_occupancy, pyplot
from atlas_tracking.viz.html_report import write_report


def test_share_heatmap_matches_a_plain_loop_over_the_artifacts_per_window_loads(overloaded_run):
    last = overloaded_run["records"][-1]
    artifact = json.loads(next((overloaded_run["dir"] / "atlas").rglob("step_00000010.json")).read_text())
    pw = artifact["per_window"]
    labels, share, delta = expert_grids(last["layers"])
    assert labels == [f"layer {lay['index']}" for lay in artifact["layers"]] == ["layer 0", "layer 1"]
    assert delta is not None
    for i, (now, base) in enumerate(zip(pw["layers"], pw["baseline"]["layers"])):
        n_experts = len(now["load"][0])
        totals, base_totals = [0.0] * n_experts, [0.0] * n_experts
        for w in range(len(now["load"])):
            for e in range(n_experts):
                totals[e] += now["load"][w][e]
                base_totals[e] += base["load"][w][e]
        for e in range(n_experts):
            expected = totals[e] / sum(totals)
            assert share[i, e] == pytest.approx(expected, abs=1e-12)
            assert delta[i, e] == pytest.approx(expected - base_totals[e] / sum(base_totals), abs=1e-12)
    assert np.abs(delta).max() > 0.01  # the overloaded expert moved


def test_report_shows_expert_load_occupancy_axes_and_c2_change_when_no_expert_dies(overloaded_run, tmp_path):
    base, last = overloaded_run["records"]
    assert base["dead_experts"] == last["dead_experts"] == 0 and last["mean_cv"] > base["mean_cv"] + 10
    page = write_report(overloaded_run["dir"], tmp_path / "report.html", png_dir=tmp_path / "png").read_text()
    for alt in ("expert load: layers x experts", "dead experts, load CV and router entropy per layer",
                "C2 heatmap: layers x gates", "per-layer change of C2 since the baseline"):
        assert re.search(rf'<img alt="{re.escape(alt)}" src="data:image/png;base64,[A-Za-z0-9+/=]{{200,}}">', page), alt
    for name in ("expert_load.png", "occupancy.png", "c2_heatmap.png", "layer_c2_delta.png"):
        assert (tmp_path / "png" / name).read_bytes()[:4] == b"\x89PNG"
    cv = [100 * lay["load_cv"] for lay in last["layers"]]
    row = re.search(r"<tr><td>layer 0</td><td>0 -&gt; 0</td><td>([\d.]+) -&gt; ([\d.]+)</td>", page)
    assert row and float(row.group(2)) == pytest.approx(cv[0], rel=1e-2) and float(row.group(2)) > float(row.group(1))
    assert "layer 0: expert 1 overloaded." in page
    fig = fig_occupancy(overloaded_run["records"])
    try:
        for ax, key in zip(fig.axes, ("dead_experts", "load_cv", "router_entropy")):
            per_layer = [line for line in ax.get_lines() if line.get_label().startswith("layer ")]
            assert len(per_layer) == 2 and all(len(line.get_xdata()) == 2 for line in per_layer), key
        cv_lines = [line.get_ydata() for line in fig.axes[1].get_lines() if line.get_label() == "layer 0"]
        assert list(cv_lines[0]) == pytest.approx([100 * base["layers"][0]["load_cv"], cv[0]])
    finally:
        pyplot().close(fig)


def test_alert_text_names_the_overloaded_experts(overloaded_run):
    alerts = overloaded_run["records"][-1]["alerts"]
    revoked = next(a for a in alerts if "revoked" in a["title"])
    assert "Experts: layer 0: expert 1 overloaded. layer 1: expert 1 overloaded." in revoked["text"]


def test_record_keeps_each_experts_load_and_the_baselines(overloaded_run):
    base, last = overloaded_run["records"]
    for b, lay in zip(base["layers"], last["layers"]):
        assert "expert_load_baseline" not in b
        assert lay["expert_load_baseline"] == b["expert_load"]
        assert sum(lay["expert_load"]) == sum(b["expert_load"]) == 8 * 16 * lay["top_k"]
    assert Path(overloaded_run["dir"] / "atlas" / "gates.jsonl").exists()


def test_report_images_load_in_a_real_browser(overloaded_run, tmp_path):
    """The report rendered by the system chromium through Playwright: every figure decodes (heatmaps included)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the dev extra)")
    if not CHROMIUM.exists():
        pytest.skip(f"no system chromium at {CHROMIUM}")
    report = write_report(overloaded_run["dir"], tmp_path / "report.html")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 1600})
            errors: list[str] = []
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.goto(report.as_uri())
            images = page.eval_on_selector_all(
                "img", "els => els.map(e => [e.alt, e.complete, e.naturalWidth, e.naturalHeight])")
        finally:
            browser.close()
    loaded = {alt: (done and w > 100 and h > 100) for alt, done, w, h in images}
    for alt in ("expert load: layers x experts", "C2 heatmap: layers x gates",
                "dead experts, load CV and router entropy per layer"):
        assert loaded.get(alt), (alt, images)
    assert all(loaded.values()) and errors == []
