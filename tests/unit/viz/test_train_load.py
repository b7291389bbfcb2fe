"""The training-batch load between gates in the report: the per-layer figure over the intervals against plain loops
over the real ``load.jsonl`` of a plain loop whose first routed layer collapses between gates and recovers
(:mod:`atlas_tracking.testing.planted_loop`), the gates and early gates marked where the gate records put them, the
alarm where the interval that raised it is; the report's section (the last interval's summary, the alarms, the
early gates) from the same files, and no section for a run without ``load.jsonl``."""

from __future__ import annotations

import html
import math
import re
import shutil

import pytest

from atlas_tracking.artifacts.history import read_history
from atlas_tracking.artifacts.load_record import read_load
from atlas_tracking.testing.planted_loop import PLANT_AT, RESTORE_AT, planted_loop
from atlas_tracking.viz.figures import fig_train_load, pyplot
from atlas_tracking.viz.html_report import load_section, write_report


def ref_cv(load):
    mean = sum(load) / len(load)
    return math.sqrt(sum((x - mean) ** 2 for x in load) / len(load)) / mean


def ref_max_over_mean(load):
    return max(load) / (sum(load) / len(load))


def ref_entropy(load):
    total = sum(load)
    return -sum(x / total * math.log(x / total) for x in load if x) / math.log(len(load))


REFS = (ref_cv, ref_max_over_mean, ref_entropy)
"""The three panels of the figure, top to bottom, from their definitions."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = planted_loop(tmp_path_factory.mktemp("planted") / "atlas")
    return {"dir": out, "lines": read_load(out), "gates": read_history(out)}


def _by_gid(ax, prefix):
    return {a.get_gid(): a for a in ax.get_children() if (a.get_gid() or "").startswith(prefix)}


def named_once(text: str) -> str:
    """``text`` as the report escapes it, with a module path's own ``(layer N)`` dropped (the report names a layer
    once: the path on hover, which the test reads back in its place)."""
    return re.sub(r"(\.\d+\.\w+) \(layer \d+\)", r"\1", html.escape(text))


def test_the_planted_run_has_what_the_views_must_show(run):
    """The record itself: the collapsed layer routes to experts 0 and 1 only in the intervals after the plant and up
    to the restore; the alarm at the second of them, its early gate there, the clearing two calm intervals later."""
    collapsed = [line for line in run["lines"] if PLANT_AT < line["first_step"] <= RESTORE_AT]
    assert [line["step"] for line in collapsed] == [8, 10]
    assert all(sum(line["layers"][0]["load"][2:]) == 0 for line in collapsed)
    assert [(line["step"], [a["level"] for a in line["alerts"]]) for line in run["lines"] if line["alerts"]] == [
        (10, ["WARN"]), (14, ["INFO"])]
    assert [(g["step"], g["trigger"]) for g in run["gates"]] == [(0, "start"), (10, "telemetry"), (12, "validation")]


def test_figure_draws_each_layers_statistics_the_summary_the_gates_and_the_alarm(run):
    lines, gates = run["lines"], run["gates"]
    steps = [line["step"] for line in lines]
    fig = fig_train_load(lines, gates)
    try:
        assert len(fig.axes) == 3
        for ax, ref in zip(fig.axes, REFS):
            layers = _by_gid(ax, "layer ")
            assert sorted(layers) == sorted(f"layer {row['layer']}" for row in lines[0]["layers"]) == [
                "layer 1", "layer 2"]
            per_interval = []
            for i, line in enumerate(lines):
                values = {row["layer"]: ref(row["load"]) for row in line["layers"]}
                per_interval.append(values)
                for layer, value in values.items():
                    drawn = layers[f"layer {layer}"]
                    assert list(drawn.get_xdata()) == steps
                    assert drawn.get_ydata()[i] == pytest.approx(value, rel=1e-9)
            (summary,) = _by_gid(ax, "summary").values()
            pick = min if ref is ref_entropy else max
            assert list(summary.get_ydata()) == pytest.approx([pick(v.values()) for v in per_interval], rel=1e-9)
            gate_marks = _by_gid(ax, "gate ") | _by_gid(ax, "early gate ")
            assert {gid: mark.get_xdata()[0] for gid, mark in gate_marks.items()} == {
                "gate 0": 0, "early gate 10": 10, "gate 12": 12}
            assert gate_marks["early gate 10"].get_color() != gate_marks["gate 12"].get_color()
            alarms = _by_gid(ax, "alarm")
            assert sorted(alarms) == ["alarm 10", "alarm standing 12"]
            span = alarms["alarm 10"]  # a Rectangle in data x
            assert (span.get_x(), span.get_x() + span.get_width()) == (8.5, 10.5)  # the interval 9-10 raised it
        legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert legend == ["layer 1", "layer 2", "worst layer (max CV)", "gate", "early gate", "alarm", "alarm standing"]
    finally:
        pyplot().close(fig)


def test_report_section_shows_the_last_interval_the_alarms_and_the_early_gate(run, tmp_path):
    lines, gates = run["lines"], run["gates"]
    page = write_report(run["dir"], tmp_path / "report.html", png_dir=tmp_path / "png").read_text()
    assert "http://" not in page
    section = page.split("<h2>Training-batch load between gates</h2>")[1].split("<h2>")[0]
    assert f"{len(lines)} interval(s)" in section and f"steps {lines[0]['first_step']}-{lines[-1]['step']}" in section
    for alt in ("training-batch load per layer between gates",
                "training-batch expert load at the last interval: layers x experts"):
        assert re.search(rf'<img alt="{re.escape(alt)}" src="data:image/png;base64,[A-Za-z0-9+/=]{{200,}}">', section)
    for name in ("train_load.png", "train_expert_load.png"):
        assert (tmp_path / "png" / name).read_bytes()[:4] == b"\x89PNG"

    last = lines[-1]
    cvs = {row["layer"]: ref_cv(row["load"]) for row in last["layers"]}
    worst = max(cvs, key=cvs.get)
    rows = dict(re.findall(r"<tr><td>(\w+)</td><td>atlas/train/\w+</td><td>(.*?)</td></tr>", section))
    name = next(row["name"] for row in last["layers"] if row["layer"] == worst)
    assert rows["worst_layer"] == f'<span class="layer" title="{name}">layer {worst}</span>'  # one name, path on hover
    assert float(rows["load_cv_max"]) == pytest.approx(cvs[worst], rel=1e-3)
    assert float(rows["entropy_min"]) == pytest.approx(min(ref_entropy(r["load"]) for r in last["layers"]), rel=1e-3)
    assert float(rows["max_over_mean"]) == pytest.approx(
        max(ref_max_over_mean(r["load"]) for r in last["layers"]), rel=1e-3)
    assert rows["tokens"] == str(last["tokens"]) and "dropped_fraction" not in rows and "overload_factor" not in rows

    plain = re.sub(r'<span class="layer" title="([^"]*)">[^<]*</span>', r"\1", section)  # the path on hover
    alerts = re.findall(r"<li>step (\d+) \((\w+)\): <b>([^<]*)</b> ([^<]*)</li>", plain)
    expected = [(str(line["step"]), a["level"], html.escape(a["title"]), named_once(a["text"]))
                for line in lines for a in line["alerts"]]
    assert alerts == expected and [a[:2] for a in alerts] == [("10", "WARN"), ("14", "INFO")]
    (early,) = [g for g in gates if g["trigger"] == "telemetry"]
    assert (f'<ul class="early"><li>step 10, read {early["status"]} / {early["stage"]}: '
            f'{named_once(early["trigger_reason"])}</li></ul>') in plain


def test_a_run_without_load_jsonl_has_no_section(run, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(run["dir"], bare, ignore=shutil.ignore_patterns("load.jsonl"))
    page = write_report(bare, tmp_path / "report.html", png_dir=tmp_path / "png").read_text()
    assert "Training-batch load between gates" not in page and "<h2>Gates</h2>" in page
    assert not (tmp_path / "png" / "train_load.png").exists() and (tmp_path / "png" / "expert_load.png").exists()


def test_summary_rows_name_dropped_routes_and_the_overload_factor():
    """A capacity limit and expert parallelism (hand-written intervals): the dropped fraction over the dropping
    layers and the largest per-layer overload of the processes' received routes; many layers get no legend each."""
    loads = [[9, 3, 0, 0], [4, 4, 4, 4]] + [[1, 2, 3, 4]] * 12
    layers = [{"layer": i, "name": f"l{i}", "load": load, "dropped": [2, 0][i] if i < 2 else None,
               "ep_tokens": [7, 3] if i == 0 else [8, 8]} for i, load in enumerate(loads)]
    lines = [{"step": 5, "first_step": 1, "tokens": 8, "layers": layers}]
    text, figures = load_section(lines, [{"step": 0, "trigger": "start"}])
    rows = dict(re.findall(r"<tr><td>(\w+)</td><td>atlas/train/\w+</td><td>([^<]*)</td></tr>", text))
    assert float(rows["dropped_fraction"]) == pytest.approx((2 + 0) / (12 + 16), rel=1e-3)
    assert float(rows["overload_factor"]) == pytest.approx(7 / 5, rel=1e-3)
    assert float(rows["dead_fraction_max"]) == 0.5 and rows["worst_layer"] == "l0"
    assert "No interval raised an alarm." in text and "No early gate ran." in text
    assert set(figures) == {"train_load.png", "train_expert_load.png"}
    fig = fig_train_load(lines, [])
    try:
        legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert legend == ["worst layer (max CV)"] and len(_by_gid(fig.axes[0], "layer ")) == 14
    finally:
        pyplot().close(fig)
    assert load_section([], []) == ("", {})
