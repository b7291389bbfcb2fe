"""The terminal cliff of ``ov_cf`` (docs/receipts.md#routing-self-consistency): depth profile and terminal jump with its window-bootstrap CI in
the receipts, the record, the trackers and the report; the note when the dominant cliff is not terminal."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from atlas_tracking.artifacts.gate_report import read_artifact, verify
from atlas_tracking.artifacts.record import gate_metrics
from atlas_tracking.gate import AtlasGate
from atlas_tracking.testing.lightning_lm import MoELM, build_qwen3_moe
from atlas_tracking.testing.tiny import QUIET, tiny_canary, tiny_data
from atlas_tracking.viz.html_report import write_report

LAYERS = 4


def four_layer_model(seed: int = 0):
    return build_qwen3_moe(seed=seed, hidden=32, layers=LAYERS, experts=8, aux_coef=0.02)


def reference(art: dict, band: int) -> dict:
    """Plain loops over the artifact's per-window arrays: profile, jumps and percentile CIs."""
    rc = art["config"]["receipts"]
    W = art["canary"]["n_windows"]
    idx = np.random.default_rng(rc["seed"]).integers(0, W, size=(rc["n_bootstrap"], W))
    ovs = [lay["ov_cf"] for lay in art["per_window"]["layers"]]

    def pooled(rows):
        return [sum(ov["sum"][w] for w in rows) / sum(ov["count"][w] for w in rows) for ov in ovs]

    prof = pooled(range(W))
    n = len(prof)
    b = min(band, n - 1)
    term = [p[-1] - sum(p[n - 1 - b:n - 1]) / b for p in (pooled(r) for r in idx)]
    alpha = (1 - rc["ci_level"]) / 2
    steps = [prof[i] - prof[i - 1] for i in range(1, n)]
    return {"profile": prof, "jump": prof[-1] - sum(prof[n - 1 - b:n - 1]) / b,
            "ci": [float(np.quantile(term, alpha)), float(np.quantile(term, 1 - alpha))],
            "cliff": 1 + steps.index(min(steps))}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """A 4-layer Qwen3-MoE trained 40 steps on prose, then one gate (the baseline) and one after 40 more."""
    tmp = tmp_path_factory.mktemp("cliff")
    module = MoELM(four_layer_model(), lr=3e-3, aux_coef=0.02)
    model = module.model
    opt = module.configure_optimizers()
    train_dl, _ = tiny_data(80)
    torch.manual_seed(0)
    gate = AtlasGate(model, tiny_canary(), QUIET, out_dir=tmp / "atlas")
    model.train()
    for i, batch in enumerate(train_dl):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i + 1 in (40, 80):
            rec = gate.run(i + 1, loss=loss.item())
            model.train()
    return {"dir": tmp / "atlas", "record": rec}


def test_trained_model_reports_profile_and_terminal_jump_with_ci(trained):
    rec = trained["record"]
    art = read_artifact(trained["dir"] / "receipts" / "step_00000080.json")
    ref = reference(art, 3)
    s = art["summary"]
    assert s["ov_cf_profile"] == pytest.approx(ref["profile"], rel=1e-12)
    assert s["ov_cf_terminal_jump"] == pytest.approx(ref["jump"], rel=1e-12, abs=1e-15)
    assert s["ov_cf_terminal_jump_ci"] == pytest.approx(ref["ci"], rel=1e-9, abs=1e-12)
    assert s["ov_cf_terminal_jump_ci"][0] <= s["ov_cf_terminal_jump"] <= s["ov_cf_terminal_jump_ci"][1]
    assert s["ov_cf_terminal_band"] == 3 and s["ov_cf_terminal_ordinal"] == LAYERS - 1
    assert s["ov_cf_adjacent_jump"] == pytest.approx(ref["profile"][-1] - ref["profile"][-2], rel=1e-12, abs=1e-15)
    assert verify(art) == []
    # the record carries the jump, its CI and the dominant cliff; the profile is the layers' ov_cf
    assert [lay["ov_cf"] for lay in rec["layers"]] == pytest.approx(ref["profile"], rel=1e-12)
    assert rec["ov_cf_terminal_jump"] == s["ov_cf_terminal_jump"] and rec["ov_cf_terminal_jump_ci"] == s["ov_cf_terminal_jump_ci"]
    assert rec["ov_cf_cliff_ordinal"] == (ref["cliff"] if min(np.diff(ref["profile"])) < 0 else None)
    line = json.loads((trained["dir"] / "gates.jsonl").read_text().splitlines()[-1])
    assert line["ov_cf_terminal_jump"] == rec["ov_cf_terminal_jump"]
    m = gate_metrics(line)
    assert m["atlas/ov_cf_terminal_jump"] == rec["ov_cf_terminal_jump"]
    assert m["atlas/ov_cf_cliff_off_terminal"] == float(rec["ov_cf_cliff_note"] is not None)
    assert all(f"atlas/layer_{i:02d}/ov_cf" in m for i in range(LAYERS))
    print("ov_cf profile", [round(v, 4) for v in ref["profile"]], "terminal jump", round(ref["jump"], 4),
          "CI", [round(v, 4) for v in ref["ci"]], "note", rec["ov_cf_cliff_note"])


def test_report_shows_the_terminal_cliff(trained, tmp_path):
    page = write_report(trained["dir"], tmp_path / "run.html").read_text()
    assert "Terminal cliff" in page and "terminal jump (layer 3 minus the band before it)" in page
    page = write_report(trained["dir"] / "receipts" / "step_00000080.json", tmp_path / "gate.html").read_text()
    assert "ov_cf depth profile [" in page


def _plant(model, layer: int, terminal_scale: float) -> None:
    """Blow up one routed layer's expert outputs (x + MoE(g) is then routed as if it were MoE(g) alone: the
    router's choice is not kept, ov_cf falls) and scale the terminal layer's by ``terminal_scale``."""
    with torch.no_grad():
        model.model.layers[layer].mlp.experts.down_proj.mul_(300.0)
        model.model.layers[LAYERS - 1].mlp.experts.down_proj.mul_(terminal_scale)


@pytest.mark.parametrize("where", ["mid", "terminal"])
def test_planted_cliff_mid_depth_fires_the_note(tmp_path, where):
    model = four_layer_model(seed=1)
    if where == "mid":
        _plant(model, 1, 0.01)  # the terminal layer barely moves its input: ov_cf near 1 there
    else:
        _plant(model, LAYERS - 1, 1.0)
    rec = AtlasGate(model, tiny_canary(), QUIET, out_dir=tmp_path).run(0)
    prof = [lay["ov_cf"] for lay in rec["layers"]]
    if where == "mid":
        assert rec["ov_cf_cliff_ordinal"] == 1 and prof[1] < prof[0] - 0.3
        assert "routed layer 1" in rec["ov_cf_cliff_note"] and "not at the terminal routed layer 3" in rec["ov_cf_cliff_note"]
    else:
        assert rec["ov_cf_cliff_ordinal"] == LAYERS - 1 and rec["ov_cf_cliff_note"] is None
        assert rec["ov_cf_terminal_jump_ci"][1] < 0
    print(where, "profile", [round(v, 3) for v in prof], "jump", round(rec["ov_cf_terminal_jump"], 3),
          rec["ov_cf_terminal_jump_ci"])
