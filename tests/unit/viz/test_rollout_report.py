"""The rollout agreement in the report: a plain loop whose rollout engine is a bf16 copy of a tiny Qwen3-MoE hands its
routes to the real ``gate.rollout`` for a few steps (one of them with a planted invalid route, a fallback); the
report's section, table and figure read that ``rollout.jsonl`` as plain loops over its lines say, and a run without
the file has no such section."""

from __future__ import annotations

import copy
import html
import re
import shutil

import numpy as np
import pytest
import torch

from atlas_tracking import AtlasGate
from atlas_tracking.artifacts.rollout_record import read_rollout
from atlas_tracking.engine.rollout import trainer_routes
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.tiny import QUIET, random_canary
from atlas_tracking.viz.figures import pyplot
from atlas_tracking.viz.html_report import rollout_section, write_report
from atlas_tracking.viz.rollout import fig_rollout

STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("rollout_run") / "atlas"
    model = family_model("qwen3_moe", seed=0).eval()
    engine = copy.deepcopy(model).to(torch.bfloat16)          # the rollout engine routes in bf16
    gate = AtlasGate(model, random_canary(), {**QUIET, "rollout": {"mismatch_bound": 0.0}}, out_dir=str(out))
    gate.run(0)
    for step in range(1, STEPS + 1):
        ids = torch.randint(1, 64, (8, 32), generator=torch.Generator().manual_seed(step))
        routes = trainer_routes(engine, ids)
        if step == STEPS:
            routes[0, 0, 1] = -1                               # one position the replay could not apply
        lp = torch.full(ids.shape, float("nan"))
        lp[:, 1:] = -4.0
        gate.rollout(step, ids, routes, rollout_logprobs=lp)
    gate.finish()
    return {"dir": out, "lines": read_rollout(out)}


def test_the_run_has_what_the_section_must_show(run):
    lines = run["lines"]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    assert any(row["mismatched"] for line in lines for row in line["layers"]), "the bf16 copy routes some position apart"
    assert [row["fallback"] for row in lines[-1]["layers"]] == [0, 1]
    assert any(a["level"] == "WARN" for line in lines for a in line["alerts"])


def _cells(text, first):
    return re.search(rf"<tr><td>{re.escape(first)}</td>((?:<td>[^<]*</td>)*)</tr>", text).group(1)


def test_the_report_holds_the_section_its_table_and_its_figure(run, tmp_path):
    lines = run["lines"]
    page = write_report(run["dir"], tmp_path / "report.html", png_dir=tmp_path / "png").read_text()
    assert page.count("<h2>Rollout agreement</h2>") == 1
    assert 'alt="rollout agreement: mismatch per layer over steps" src="data:image/png;base64,' in page
    assert (tmp_path / "png" / "rollout_agreement.png").stat().st_size > 1000
    assert f"{STEPS} recorded step(s), steps 1-{STEPS}, 256 token positions at the last; routes not replayed" in page
    section = page[page.index("<h2>Rollout agreement</h2>"):page.index("<h2>Per-layer C2")]
    for layer in (0, 1):
        rows = [line["layers"][layer] for line in lines]
        cells = re.findall(r"<td>([^<]*)</td>", _cells(section, f"layer {layer}"))
        expected = [np.mean([r["mismatch"] for r in rows]), rows[-1]["mismatch"], np.mean([r["jaccard"] for r in rows]),
                    np.mean([r["near_tie"]["bf16"] for r in rows]), np.mean([r["near_tie"]["fp16"] for r in rows])]
        assert [float(c) for c in cells[:5]] == pytest.approx(expected, rel=1e-3, abs=1e-9)
        assert cells[5] == f"{sum(r['fallback'] for r in rows)} of {sum(r['tokens'] for r in rows)}"
    # first differing layer, summed over the steps by a plain loop
    first = section.split("First differing layer")[1]
    for label, n in [*((f"layer {layer}", sum(line["first_mismatch"]["by_layer"][str(layer)] for line in lines))
                       for layer in (0, 1)),
                     ("none (every layer agrees)", sum(line["first_mismatch"]["none"] for line in lines))]:
        assert re.findall(r"<td>([^<]*)</td>", _cells(first, label))[0] == str(n)
    # the log-probabilities and the alerts, as the lines have them
    assert f"mean absolute difference {lines[-1]['logprobs']['abs_diff_mean']:.4g} at the last step" in section
    assert re.search(r'<a href="[^"]*rollout[^"]*#the-alarm">docs/rollout.md#the-alarm</a>', section)  # linked
    unlinked = re.sub(r'<a href="[^"]*">([^<]*)</a>', r"\1", section)
    unlinked = re.sub(r'<span class="layer" title="([^"]*)">[^<]*</span>', r"\1", unlinked)  # the path on hover
    items = re.findall(r"<li>step (\d+) \((\w+)\): <b>([^<]*)</b> ([^<]*)</li>", unlinked)
    assert items == [(str(line["step"]), a["level"], html.escape(a["title"]), re.sub(r"(\.\d+\.\w+) \(layer \d+\)", r"\1", html.escape(a["text"])))  # the path, named once
                     for line in lines for a in line["alerts"]]


def test_the_figure_draws_each_layers_mismatch_and_near_tie_over_steps(run):
    lines = run["lines"]
    steps = [line["step"] for line in lines]
    fig = fig_rollout(lines)
    try:
        top, bottom = fig.axes
        drawn = {a.get_gid(): a for a in top.get_children() if a.get_gid()}
        ties = {a.get_gid(): a for a in bottom.get_children() if a.get_gid()}
        for i, layer in enumerate(row["layer"] for row in lines[0]["layers"]):
            assert list(drawn[f"layer {layer}"].get_xdata()) == steps
            assert list(drawn[f"layer {layer}"].get_ydata()) == [line["layers"][i]["mismatch"] for line in lines]
            assert list(ties[f"near tie layer {layer}"].get_ydata()) == [line["layers"][i]["near_tie"]["bf16"]
                                                                        for line in lines]
        anywhere = [1 - line["first_mismatch"]["none"] / line["first_mismatch"]["tokens"] for line in lines]
        assert list(drawn["token mismatch"].get_ydata()) == pytest.approx(anywhere, abs=1e-6)
        warned = [line["step"] for line in lines if any(a["level"] == "WARN" for a in line["alerts"])]
        assert sorted(g for g in drawn if g.startswith("alarm ")) == sorted(f"alarm {s}" for s in warned)
    finally:
        pyplot().close(fig)


def test_a_run_without_rollout_jsonl_has_no_section(run, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(run["dir"], bare, ignore=shutil.ignore_patterns("rollout.jsonl"))
    page = write_report(bare, tmp_path / "report.html", png_dir=tmp_path / "png").read_text()
    assert "Rollout agreement" not in page and "<h2>Gates</h2>" in page
    assert not (tmp_path / "png" / "rollout_agreement.png").exists() and (tmp_path / "png" / "expert_load.png").exists()
    assert rollout_section([]) == ("", {})
