"""The pass/fail layer: protected-atlas rewrite, base-domain damage and knowledge-expansive, at every post-training
gate, with their tracker codes and alerts."""

from __future__ import annotations

import pytest

from atlas_tracking.artifacts.record import gate_metrics
from atlas_tracking.decisions.predicates import base_damage, protected_rewrite
from atlas_tracking.decisions.replay import replay
from atlas_tracking.schema.config import AtlasConfig

BASE = {"step": 0, "c2": 0.10, "dead_experts": 2.0, "min_entropy": 3.0, "mean_cv": 50.0, "loss": 5.0,
        "phase": "post_training"}
POST = AtlasConfig.from_dict({"policy": {"phase": "post_training"}})


@pytest.mark.parametrize("margin, ci, verdict", [
    (0.10, [0.05, 0.2], "pass"), (0.0, [-0.01, 0.01], "pass"), (-0.02, [-0.05, 0.01], "at risk"),
    (-0.02, [-0.05, -0.001], "fail"), (-0.02, None, "fail"), (None, None, "not measured")])
def test_protected_rewrite_reads_the_refinement_margin_and_its_ci(margin, ci, verdict):
    assert protected_rewrite({"refine_margin": margin, "refine_margin_ci": ci})["verdict"] == verdict


def test_a_negative_margin_with_a_ci_reaching_zero_fails_without_the_ci_rule():
    assert protected_rewrite({"refine_margin": -0.02, "refine_margin_ci": [-0.05, 0.01]}, use_ci=False)["verdict"] == (
        "fail")


@pytest.mark.parametrize("kl, kl_ci, nll, nll_ci, verdict", [
    (0.01, [0.0, 0.02], 0.0, [-0.01, 0.01], "pass"),
    (0.08, [0.06, 0.10], 0.0, [-0.01, 0.01], "fail"),      # KL beyond 0.05 with its CI excluding 0
    (0.08, [-0.01, 0.2], 0.0, [-0.01, 0.01], "at risk"),   # beyond, but the CI reaches 0
    (0.01, [0.0, 0.02], 0.07, [0.02, 0.12], "fail"),       # the NLL axis alone
    (None, None, 0.07, [0.02, 0.12], "fail"),              # a base saved without log-probabilities: NLL only
    (0.15, [0.13, 0.16], -0.06, [-0.08, -0.04], "pass"),   # moved, but the canary NLL improved: learning
    (0.15, [0.13, 0.16], -0.06, [-0.08, 0.01], "fail"),    # moved, and the NLL did not surely improve
    (None, None, None, None, "not measured")])
def test_base_damage_reads_the_cumulative_damage_and_its_ci(kl, kl_ci, nll, nll_ci, verdict):
    rec = {"kl_base_cumulative": kl, "kl_base_cumulative_ci": kl_ci, "canary_nll_delta_cumulative": nll,
           "canary_nll_delta_cumulative_ci": nll_ci, "base_step": 0}
    assert base_damage(rec, 0.05, 0.05)["verdict"] == verdict


def _gate(step: int, kl: float, margin: float) -> dict:
    return {**BASE, "step": step, "phase": None, "refine_margin": margin, "refine_margin_ci": [margin - 0.01,
            margin + 0.005], "base_step": 0, "kl_base_cumulative": kl, "kl_base_cumulative_ci": [kl - 0.01, kl + 0.01],
            "canary_nll_delta_cumulative": 0.0, "canary_nll_delta_cumulative_ci": [-0.01, 0.01]}


def test_every_post_training_gate_after_the_baseline_carries_the_three_predicates_and_alerts_on_fail():
    gates = [BASE, _gate(1, 0.01, 0.2), _gate(2, 0.09, -0.03), _gate(3, 0.10, -0.04), _gate(4, 0.01, 0.1),
             _gate(5, 0.09, -0.03)]
    out = replay(gates, POST)
    assert out[0]["predicates"] is None
    assert [o["predicates"]["protected_rewrite"]["verdict"] for o in out[1:]] == ["pass", "fail", "fail", "pass",
                                                                                   "fail"]
    assert [o["predicates"]["base_damage"]["verdict"] for o in out[1:]] == ["pass", "fail", "fail", "pass", "fail"]
    assert all(o["predicates"]["knowledge_expansive"]["verdict"] == "not judged" for o in out[1:])
    keys = [[a["key"] for a in o["alerts"] if a["key"].startswith("predicate:")] for o in out]
    # a predicate alerts when it turns fail, not while it stays failed
    assert keys == [[], [], ["predicate:protected_rewrite", "predicate:base_damage"], [], [],
                    ["predicate:protected_rewrite", "predicate:base_damage"]]
    assert "since the base (step 0)" in out[2]["predicates"]["base_damage"]["reason"]
    metrics = gate_metrics({**gates[2], **out[2]})
    assert (metrics["atlas/predicate/protected_rewrite"], metrics["atlas/predicate/base_damage"]) == (2.0, 2.0)


def test_pretraining_gates_carry_no_predicates():
    pre = AtlasConfig.from_dict({"policy": {"phase": "pretraining"}})
    out = replay([{**BASE, "phase": None}, {**BASE, "step": 1, "phase": None}], pre)
    assert [o["predicates"] for o in out] == [None, None]


def test_the_alert_level_is_configuration():
    cfg = AtlasConfig.from_dict({"policy": {"phase": "post_training"}, "alerts": {"on_rewrite": "ERROR",
                                                                                  "on_base_damage": "off"}})
    out = replay([BASE, _gate(1, 0.09, -0.03)], cfg)
    assert [(a["level"], a["key"]) for a in out[1]["alerts"] if a["key"].startswith("predicate:")] == [
        ("ERROR", "predicate:protected_rewrite")]
