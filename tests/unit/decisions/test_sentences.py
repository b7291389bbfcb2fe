"""Every sentence a post-training gate says agrees with its numbers.

The rule walk reads every rule of :mod:`atlas_tracking.decisions.sentences` at every combination of the evidence
the policy can produce (a ``clean`` stage only with a GREEN reading, a bad stage only with a bad one) and in
both directions of the objective, and fails on any interpretation, licensed claim or action that states something
the evidence contradicts. The policy tests then read whole gates: a loss trend ``unknown`` never "improves", a
failing base-damage predicate licenses no "objective improved", and a stalling objective in ``intervene`` is never
told to wait for the next gate.
"""

from __future__ import annotations

import itertools

import pytest

from atlas_tracking.decisions import sentences as S
from atlas_tracking.decisions.policy import GatePolicy, GateSummary
from atlas_tracking.decisions.replay import replay

STAGES = ("clean", "recovering", "revoked", "alert", "prepare", "intervene")
"""The stages a post-training gate after its baseline can be in."""
OBJECTIVES = (("loss", "minimize"), ("eval_reward", "maximize"))


def _reachable(ev: S.Evidence) -> bool:
    """A ``clean`` stage needs a GREEN reading (C2 not worsening, occupancy healthy); a GREEN reading moves a bad
    stage to ``recovering``, so ``revoked``, ``alert``, ``prepare`` and ``intervene`` hold a bad one (Table 13)."""
    green = ev.c2_trend != "worsening" and ev.occupancy == "healthy"
    return green if ev.stage == "clean" else (ev.stage == "recovering" or not green)


def _walk():
    for c2, occ, loss, canary, damage, rewrite, stage, (obj, direction), margin in itertools.product(
            S.C2_TRENDS, S.OCCUPANCY, S.LOSS_TRENDS, S.CANARY, S.PREDICATE_VERDICTS, S.PREDICATE_VERDICTS, STAGES,
            OBJECTIVES, (False, True)):
        ev = S.Evidence(c2_trend=c2, occupancy=occ, loss_trend=loss, canary=canary, base_damage=damage, stage=stage,
                        objective=obj, direction=direction, protected_rewrite=rewrite, margin=margin,
                        canary_delta=None if canary == "unknown" else (0.35 if canary == "worse" else -0.01))
        if _reachable(ev):
            yield ev


def test_every_rule_at_every_combination_of_its_inputs_agrees_with_the_evidence():
    walked, fired = 0, set()
    for ev in _walk():
        walked += 1
        said = [S.interpretation(ev), *S.licensed(ev), S.action(ev)]
        assert S.contradictions(said, ev) == [], ev
        assert all(s.strip() for s in said + S.unlicensed(ev))
        fired |= {("interpretation", S._rule(S.INTERPRETATION_RULES, ev).name), ("action", S._rule(S.ACTION_RULES,
                                                                                                      ev).name)}
        fired |= {("licensed", r.name) for r in S.LICENSED_RULES if r.when(ev)}
        fired |= {("unlicensed", r.name) for r in S.UNLICENSED_RULES if r.when(ev)}
    assert walked > 10_000
    # every rule is reached by some combination (none is dead)
    every = ({("interpretation", r.name) for r in S.INTERPRETATION_RULES} | {("action", r.name) for r in S.ACTION_RULES}
             | {("licensed", r.name) for r in S.LICENSED_RULES} | {("unlicensed", r.name) for r in S.UNLICENSED_RULES})
    assert every - fired == set()


def test_each_rule_reads_only_evidence_it_names():
    fields = set(S.Evidence.__dataclass_fields__)
    for rule in (*S.INTERPRETATION_RULES, *S.LICENSED_RULES, *S.UNLICENSED_RULES, *S.ACTION_RULES):
        assert set(rule.inputs) <= fields, rule.name


@pytest.mark.parametrize("said, ev, why", [
    ("Objective improves, but usage is narrowing.", dict(loss_trend="unknown"), "trend is unknown"),
    ("The objective improved on the visited region (loss / State3).", dict(canary="worse"), "base domain is damaged"),
    ("The objective improved on the visited region (loss / State3).", dict(base_damage="fail"), "base domain"),
    ("The objective is stalling; Watch the next gate before attributing the stall to the atlas.",
     dict(loss_trend="stalling", stage="intervene"), "stage is intervene"),
    ("The loss fell.", dict(objective="eval_reward", direction="maximize"), "not a loss"),
    ("eval_reward fell on the training data.", dict(objective="eval_reward", direction="maximize"), "other way"),
])
def test_the_check_catches_each_contradiction_it_names(said, ev, why):
    """The check is able to fail: each sentence here contradicts its evidence (the text of finding 1 and 2)."""
    evidence = S.Evidence(**{"c2_trend": "stable", "occupancy": "healthy", "loss_trend": "improving", **ev})
    found = S.contradictions([said], evidence)
    assert found and why in found[0]


BASE = {"step": 0, "c2": 0.10, "dead_experts": 2.0, "min_entropy": 3.0, "mean_cv": 50.0, "loss": 5.0}
DAMAGE = {"base_step": 0, "kl_base_cumulative": 0.02, "kl_base_cumulative_ci": [0.01, 0.03],
          "canary_nll_delta_cumulative": 0.35, "canary_nll_delta_cumulative_ci": [0.30, 0.40]}
"""The demo's stressed run at steps 300-750: the canary NLL +0.35 above the base, base damage failing."""


def test_an_unknown_loss_trend_never_says_the_objective_improves():
    # the first gate after the baseline has no loss at the baseline: its trend is unknown
    out = replay([{**BASE, "loss": None}, {**BASE, "step": 150, "dead_experts": 9.0, "mean_cv": 80.0}])
    last = out[-1]
    assert (last["loss_trend"], last["occupancy"], last["stage"]) == ("unknown", "degrading", "revoked")
    texts = [last["interpretation"], last["action"], *last["licensed"], *(a["text"] for a in last["alerts"])]
    assert not any("improv" in t.lower() for t in texts), texts
    assert last["interpretation"].startswith("No trend of the loss yet")


def test_a_failing_base_damage_licenses_no_objective_improvement():
    out = replay([BASE, {**BASE, "step": 300, "loss": 4.0, **DAMAGE}])
    last = out[-1]
    assert (last["loss_trend"], last["status"], last["predicates"]["base_damage"]["verdict"]) == (
        "improving", "GREEN", "fail")
    assert not any("objective improved" in c for c in last["licensed"]), last["licensed"]
    assert any(c.startswith("That the objective improved") and "+0.3500" in c for c in last["unlicensed"])
    assert "canary NLL rose +0.3500 since the base" in last["interpretation"]
    assert last["action"].startswith("Do not continue on the structural read alone: base_damage fails")
    # without the damage the same gate licenses the claim
    clean = replay([BASE, {**BASE, "step": 300, "loss": 4.0}])[-1]
    assert "The objective improved on the visited region (loss / State3)." in clean["licensed"]


def test_a_stalling_reward_in_intervene_is_told_what_the_stage_says():
    """The GRPO report's second line said "Watch the next gate" beside "Intervene or stop claiming progress"."""
    policy = GatePolicy()
    rows = [(0, 0.10, 2.0, 3.0, 50.0, 0.30), (10, 0.10, 9.0, 3.0, 80.0, 0.30), (20, 0.10, 10.0, 3.0, 81.0, 0.30),
            (30, 0.10, 11.0, 3.0, 82.0, 0.30), (40, 0.10, 12.0, 3.0, 83.0, 0.30)]
    out = [policy.read(GateSummary(*r, loss_key="eval_reward", objective_direction="maximize")) for r in rows]
    last = out[-1]
    assert (last.status, last.stage, last.loss_trend) == ("YELLOW", "intervene", "stalling")
    assert "Watch the next gate" not in last.interpretation and "Intervene or reset." in last.interpretation
    assert "(eval_reward) is stalling" in last.interpretation and "the loss" not in last.interpretation
