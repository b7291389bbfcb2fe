"""Drift receipts: identity is exactly zero; router, expert and backbone changes separate; compare CLI."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from atlas_tracking import AtlasConfig, Baseline, Canary, measure
from atlas_tracking.artifacts.gate_report import verify
from atlas_tracking.cli import main
from atlas_tracking.testing.families import family_model

CFG = AtlasConfig.from_dict({"receipts": {"progress": False, "n_bootstrap": 200, "anchors": 128}})
DRIFTS = ("coord_drift", "boundary_drift", "transition_drift", "content_drift")


@pytest.fixture(scope="module")
def setup():
    model = family_model("qwen3_moe", seed=2)
    canary = Canary.from_token_ids(np.random.default_rng(0).integers(0, 64, 6000), window=24, n_windows=8, seed=0)
    return model, canary, Baseline.from_report(measure(model, canary, config=CFG))


def _drift(model, canary, base, mutate):
    m = copy.deepcopy(model)
    with torch.no_grad():
        for layer in m.model.layers:
            mutate(layer)
    report = measure(m, canary, baseline=base, config=CFG)
    assert verify(json.loads(report.to_json())) == []
    return report.drift


def test_identity_gives_exact_zero_drift_and_reference_margins(setup):
    model, canary, base = setup
    d = _drift(model, canary, base, lambda layer: None)
    assert all(layer[k] == 0.0 for layer in d["layers"] for k in DRIFTS)
    assert all(layer["c2_delta"] == 0.0 and layer["dead_experts_delta"] == 0.0 for layer in d["layers"])
    assert d["refine_margin"] == CFG.lifecycle.tau
    assert d["handoff_margin"] == 0.0  # exactly, dead experts (pi_min = 0) on both sides included


def test_router_only_moves_routing_not_content(setup):
    model, canary, base = setup
    d = _drift(model, canary, base, lambda layer: layer.mlp.gate.weight.add_(0.2 * torch.randn_like(layer.mlp.gate.weight)))
    assert all(layer["boundary_drift"] > 0 and layer["transition_drift"] > 0 for layer in d["layers"])
    assert all(layer["content_drift"] == 0.0 for layer in d["layers"])
    assert d["layers"][0]["coord_drift"] == 0.0  # nothing upstream of the first routed layer changed


def test_experts_only_move_content_not_routing(setup):
    model, canary, base = setup
    d = _drift(model, canary, base, lambda layer: layer.mlp.experts.down_proj.add_(
        0.05 * torch.randn_like(layer.mlp.experts.down_proj)))
    assert all(layer["content_drift"] > 0 for layer in d["layers"])
    assert all(layer["boundary_drift"] == 0.0 and layer["transition_drift"] == 0.0 for layer in d["layers"])


def test_backbone_only_moves_coordinates_at_base_anchored_states(setup):
    model, canary, base = setup
    d = _drift(model, canary, base, lambda layer: layer.self_attn.o_proj.weight.add_(
        0.1 * torch.randn_like(layer.self_attn.o_proj.weight)))
    assert all(layer["coord_drift"] > 0 for layer in d["layers"])
    assert all(layer[k] == 0.0 for layer in d["layers"] for k in ("boundary_drift", "transition_drift", "content_drift"))


def test_routing_change_concentrates_at_the_boundary(setup):
    model, canary, base = setup
    d = _drift(model, canary, base, lambda layer: layer.mlp.gate.weight.add_(0.02 * torch.randn_like(layer.mlp.gate.weight)))
    for layer in d["layers"]:
        assert layer["boundary_change_share"] > layer["boundary_change_null"]


def test_compare_cli_on_two_checkpoints(setup, tmp_path, capsys):
    model, canary, _ = setup
    model.save_pretrained(tmp_path / "base")
    cand = copy.deepcopy(model)
    with torch.no_grad():
        cand.model.layers[0].mlp.gate.weight.add_(0.3 * torch.randn_like(cand.model.layers[0].mlp.gate.weight))
    cand.save_pretrained(tmp_path / "cand")
    canary.save(tmp_path / "canary.npz")
    rc = main(["compare", "--base", str(tmp_path / "base"), "--candidate", str(tmp_path / "cand"),
               "--canary", str(tmp_path / "canary.npz"), "--out", str(tmp_path / "drift.json")])
    assert rc == 0
    doc = json.loads((tmp_path / "drift.json").read_text())
    assert [set(DRIFTS) <= set(layer) for layer in doc["layers"]] == [True, True]
    assert doc["layers"][0]["boundary_drift"] > 0 and doc["layers"][1]["content_drift"] == 0.0
    assert isinstance(doc["handoff_margin"], float) and isinstance(doc["refine_margin"], float)
    out = capsys.readouterr().out
    assert "handoff_margin=" in out and "model.layers.0.mlp" in out


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"])
def test_every_family_in_bf16_measures_verifies_and_has_exact_zero_self_drift(family):
    model = family_model(family, dtype=torch.bfloat16)
    canary = Canary.from_token_ids(np.random.default_rng(1).integers(0, 64, 3000), window=16, n_windows=4, seed=0)
    base = Baseline.from_report(measure(model, canary, config=CFG))
    report = measure(model, canary, baseline=base, config=CFG)
    assert verify(json.loads(report.to_json())) == []
    assert all(layer[k] == 0.0 for layer in report.drift["layers"] for k in DRIFTS)
