"""Lifecycle phases on the demo model: a step-0 baseline of random weights is read in pretraining
(no false alarm, the reference rolls forward, handoff readiness reported), a loaded trained model
in post-training, and a planted routing collapse raises the occupancy alert at the next gate."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from atlas_tracking import Canary
from atlas_tracking.decisions.phases import model_vocab_size
from atlas_tracking.gate import AtlasGate
from atlas_tracking.testing.demo_data import encode, prose_text
from atlas_tracking.testing.lightning_lm import MoELM, build_qwen3_moe, loaders

CONFIG = {"receipts": {"progress": False, "n_bootstrap": 200, "anchors": 256}}
STEPS = 150
"""The demo's first pretraining gate (batch 16 x 128 tokens, lr 3e-3, load balancing 0.02)."""


def plant_routing_collapse(model: nn.Module, input_ids: torch.Tensor) -> None:
    """Send every token to one of two pairs of experts: the rows of experts 0 and 1 set to 50 x the unit mean of
    the router's own input, every other row to 0. A token that projects positively on the mean takes experts 0
    and 1; one that does not sees the other experts tie at 0 and takes the same two of them (topk's tie order),
    so at most four experts of each layer stay alive on any machine."""
    inputs: dict[int, torch.Tensor] = {}
    blocks = [layer.mlp for layer in model.model.layers]
    hooks = [blk.gate.register_forward_pre_hook(lambda _m, a, i=i: inputs.__setitem__(i, a[0].reshape(-1, a[0].shape[-1])))
             for i, blk in enumerate(blocks)]
    with torch.no_grad():
        model(input_ids=input_ids)
        for h in hooks:
            h.remove()
        for i, blk in enumerate(blocks):
            u = inputs[i].mean(0)
            w = blk.gate.weight
            w.zero_()
            w[0] = w[1] = 50 * u / u.norm()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """Gates 0 and 150 of from-scratch pretraining, a fresh gate on the trained model, then a planted collapse."""
    tmp = tmp_path_factory.mktemp("phases")
    prose = encode(prose_text())
    train_s, val_s = prose[:400_000], prose[400_000:450_000]
    canary = Canary.from_token_ids(prose[450_000:], window=128, n_windows=16, seed=0)
    module = MoELM(build_qwen3_moe(seed=0), lr=3e-3, aux_coef=0.02)
    model = module.model
    gate = AtlasGate(model, canary, CONFIG, out_dir=tmp / "pretraining")
    out = {"first": gate.run(0)}
    train_dl, _ = loaders(train_s, val_s, window=128, batch=16, steps=STEPS, seed=0)
    opt = module.configure_optimizers()
    torch.manual_seed(0)
    model.train()
    for batch in train_dl:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    out["second"] = gate.run(STEPS, loss=loss.item())
    out["reference_step"] = json.loads((tmp / "pretraining" / "baseline" / "manifest.json").read_text())["step"]
    out["loaded"] = AtlasGate(copy.deepcopy(model), canary, CONFIG, out_dir=tmp / "loaded").run(0)
    plant_routing_collapse(model, next(iter(train_dl)))
    out["planted"] = gate.run(STEPS + 1)
    return out


@pytest.mark.slow
def test_random_weight_baseline_reads_pretraining_without_a_false_alarm(run):
    first, second = run["first"], run["second"]
    assert (first["status"], first["phase"]) == ("BASELINE", "pretraining")
    assert "freshly initialised" in first["phase_source"] and first["vocab_size"] == 256
    assert second["loss"] < 3.0 < first["canary_nll"]
    assert (second["phase"], second["status"], second["stage"]) == ("pretraining", "GREEN", "forming")
    assert [a for a in second["alerts"] if a["level"] in ("WARN", "ERROR")] == []
    assert second["collapse"] == [] and second["handoff"]["ready"] is False
    assert second["handoff"]["reasons"][0].startswith("atlas not yet stable: 0 of 2 consecutive stable gates")


@pytest.mark.slow
def test_the_reference_rolls_forward_gate_to_gate(run):
    first, second = run["first"], run["second"]
    assert second["baseline_step"] == 0 and run["reference_step"] == STEPS
    assert second["c2_delta"] == pytest.approx(second["c2"] - first["c2"], abs=1e-12)
    assert second["handoff"]["margin"] == second["handoff_margin"]


@pytest.mark.slow
def test_a_loaded_trained_model_reads_post_training(run):
    loaded = run["loaded"]
    assert (loaded["status"], loaded["phase"], loaded["handoff"]) == ("BASELINE", "post_training", None)
    assert "a trained model" in loaded["phase_source"]


@pytest.mark.slow
def test_planted_routing_collapse_raises_the_occupancy_alert_at_the_next_gate(run):
    planted = run["planted"]
    assert (planted["status"], planted["stage"]) == ("YELLOW", "collapse")
    assert all(layer["dead_experts"] > 16 for layer in planted["layers"])
    assert [(a["level"], a["title"]) for a in planted["alerts"]] == [
        ("WARN", f"atlas: occupancy collapse at step {STEPS + 1}")]
    assert {reason.split(":")[0] for reason in planted["collapse"]} == {layer["name"] for layer in planted["layers"]}
    assert planted["handoff"]["ready"] is False


def test_vocab_size_is_found_on_the_model_or_a_wrapper():
    model = build_qwen3_moe(seed=0, hidden=16, layers=1, experts=4)
    assert model_vocab_size(model) == 256 and model_vocab_size(MoELM(model)) == 256
    assert model_vocab_size(nn.Linear(2, 2)) is None
