"""The gate's objective and its direction: the loss trend, the sentences, replay and the judge read each record in its
own direction; the ``objective`` configuration; the callbacks' metric source (docs/policy.md#the-objective)."""

from __future__ import annotations

import random
import warnings

import pytest

from atlas_tracking.callbacks import LossSource, MissingObjectiveError
from atlas_tracking.decisions.judge import judge_many_records, judge_records
from atlas_tracking.decisions.policy import GatePolicy, GateSummary, PolicyInputError
from atlas_tracking.decisions.replay import replay
from atlas_tracking.schema.config import AtlasConfig, ConfigError, ObjectiveConfig, default_direction


def gates(values: list[float], direction: str | None, metric: str | None = None) -> list[dict]:
    """A healthy run (the same geometry at every gate) whose objective takes ``values``; the first gate is the
    baseline, without a loss, as a callback's step-0 baseline is. ``direction`` None: a record without one."""
    out = []
    for i, value in enumerate([None, *values]):
        rec = {"step": 10 * i, "c2": 0.05, "dead_experts": 0, "min_entropy": 2.0, "mean_cv": 50.0, "loss": value,
               "loss_key": metric}
        if direction is not None:
            rec["objective_direction"] = direction
        out.append(rec)
    return out


def reference_trends(values: list[float], direction: str, window: int = 2, tol: float = 0.0) -> list[str]:
    """Each gate's loss trend by a plain loop: improving when better than the value ``window`` gates back (or the
    first) by more than ``tol`` and not worse than the previous value by more than ``tol``."""
    out = ["unknown", "unknown"]  # the baseline, then the first gate with nothing earlier to compare with
    for i in range(1, len(values)):
        now, ref, prev = values[i], values[max(0, i - window)], values[i - 1]
        if direction == "maximize":
            improving = now > ref + tol and now >= prev - tol
        else:
            improving = now < ref - tol and now <= prev + tol
        out.append("improving" if improving else "stalling")
    return out


def trends(records: list[dict], config: AtlasConfig | None = None) -> list[str]:
    policy = GatePolicy(config)
    return [policy.read(GateSummary.from_dict(r)).loss_trend for r in records]


@pytest.mark.parametrize("direction", ["minimize", "maximize"])
@pytest.mark.parametrize("window, tol", [(2, 0.0), (3, 0.02)])
def test_the_trend_reads_improvement_in_the_objectives_direction(direction, window, tol):
    config = AtlasConfig.from_dict({"policy": {"loss_window": window, "loss_tol": tol}})
    rng = random.Random(0)
    for _ in range(50):
        values = [round(rng.uniform(0.0, 1.0), 2) for _ in range(rng.randint(1, 8))]
        expected = reference_trends(values, direction, window, tol)
        assert trends(gates(values, direction), config) == expected, values


def test_a_rising_reward_improves_when_maximised_and_stalls_when_read_as_a_loss():
    rewards = [0.0, 0.02, 0.04, 0.06]  # the GRPO reward, rising from 0 to 0.06
    assert trends(gates(rewards, "maximize"))[2:] == ["improving"] * 3
    assert trends(gates(rewards, "minimize"))[2:] == ["stalling"] * 3
    assert trends(gates(rewards, None))[2:] == ["stalling"] * 3  # a record without a direction is minimised


def test_only_gates_read_in_the_same_direction_are_compared():
    records = gates([0.5, 0.6], "maximize") + gates([0.4], "minimize")[1:]
    records[-1]["step"] = 30
    assert trends(records) == ["unknown", "unknown", "improving", "unknown"]


def test_the_sentences_name_a_maximised_objective():
    policy = GatePolicy()
    *_, last = [policy.read(GateSummary.from_dict(r)) for r in gates([0.1, 0.2, 0.3], "maximize", "eval_reward")]
    assert last.loss_trend == "improving"
    assert "The objective improved on the visited region (eval_reward / State3)." in last.licensed
    assert "Whether progress came from a narrowed visited region, from eval_reward alone." in last.unlicensed
    policy = GatePolicy()
    *_, last = [policy.read(GateSummary.from_dict(r)) for r in gates([0.3, 0.2, 0.1], "minimize", "eval_loss")]
    assert "The objective improved on the visited region (loss / State3)." in last.licensed


def test_replay_reads_each_record_in_its_own_direction_whatever_the_config_says():
    records = gates([0.1, 0.3, 0.2, 0.5], "maximize", "eval_reward")
    live = trends(records)
    against = AtlasConfig.from_dict({"objective": {"metric": "eval_loss", "direction": "minimize"}})
    assert [d["loss_trend"] for d in replay(records, against)] == live == reference_trends([0.1, 0.3, 0.2, 0.5],
                                                                                           "maximize")


def test_a_bad_direction_in_a_record_is_an_input_error_naming_it():
    with pytest.raises(PolicyInputError, match="field 'objective_direction' must be one of minimize, maximize, got 'up'"):
        GateSummary.from_dict({**gates([1.0], "minimize")[1], "objective_direction": "up"})


# --- the judge ---------------------------------------------------------------------------------------


def run(values: list[float], direction: str, metric: str | None = "eval_reward", *, fixed: bool) -> list[dict]:
    """A judged run: the stressed geometry, or a fixed one (C2 up, occupancy broader), objective ``values``."""
    geometry = ({"c2": 0.02, "dead_experts": 200, "min_entropy": 2.6, "mean_cv": 160} if fixed else
                {"c2": -0.03, "dead_experts": 285, "min_entropy": 2.3, "mean_cv": 190})
    first = {"step": 0, "loss": None, "c2": 0.08, "dead_experts": 42, "min_entropy": 3.0, "mean_cv": 140}
    return ([] if fixed else [first]) + [
        {"step": 10 * (i + 1), "loss": v, "loss_key": metric, "objective_direction": direction, "margin": 0.01,
         **geometry} for i, v in enumerate(values)]


@pytest.mark.parametrize("direction", ["minimize", "maximize"])
@pytest.mark.parametrize("candidate", [[0.41, 0.48], [0.41, 0.44], [0.52, 0.60], [0.36, 0.42]])
def test_scalar_quality_reads_the_objectives_direction(direction, candidate):
    stressed, tol = [0.40, 0.50], 0.05
    out = judge_records(run(stressed, direction, fixed=False), run(candidate, direction, fixed=True), loss_tol=tol)
    best = max(candidate) if direction == "maximize" else min(candidate)
    reaches = best >= stressed[-1] - tol if direction == "maximize" else best <= stressed[-1] + tol
    (scalar,) = [c for c in out["checks"] if c["name"] == "scalar_quality"]
    assert (scalar["passed"], scalar["candidate_best_loss"]) == (reaches, best)
    assert out["verdict"] == ("real fix" if reaches else "not yet")
    assert out["objective"] == {"metric": "eval_reward", "direction": direction}
    if not reaches:
        side = "below" if direction == "maximize" else "above"
        assert f"the candidate's best eval_reward {best:.4g} (step" in scalar["note"] and f" {side} the stressed" in scalar["note"]


def test_persistence_reads_a_gate_better_than_every_stressed_one_against_the_stressed_final_gate():
    stressed = run([0.50, 0.40], "maximize", fixed=False)  # the stressed reward fell: its final gate is step 20
    out = judge_records(stressed, run([0.51, 0.70], "maximize", fixed=True), loss_tol=0.05)
    assert [(u["step"], u["against"]) for u in out["unpaired"]] == [(20, 20)]
    as_loss = judge_records(run([0.50, 0.40], "minimize", fixed=False), run([0.51, 0.70], "minimize", fixed=True))
    assert [(u["step"], u["against"]) for u in as_loss["unpaired"]] == [(20, 10)]  # nearest: 0.70 is worse than all


def test_runs_of_different_objectives_are_not_comparable():
    stressed = run([0.40, 0.50], "maximize", fixed=False)
    cases = {
        "different objectives: stressed eval_reward (maximize), candidate eval_reward (minimize)":
            run([0.41, 0.48], "minimize", fixed=True),
        "different objectives: stressed eval_reward (maximize), candidate eval_accuracy (maximize)":
            run([0.41, 0.48], "maximize", "eval_accuracy", fixed=True),
        "the candidate run's history reads more than one objective: eval_loss (minimize), eval_reward (maximize)":
            run([0.41], "maximize", fixed=True) + run([0.48], "minimize", "eval_loss", fixed=True),
    }
    for reason, candidate in cases.items():
        out = judge_records(stressed, candidate)
        assert (out["verdict"], out["reason"]) == ("not comparable", reason)
    unnamed = run([0.41, 0.48], "maximize", None, fixed=True)  # a plain loop's gates name no metric
    assert judge_records(stressed, unnamed)["verdict"] == "real fix"


def test_several_candidates_name_those_that_reached_a_maximised_target():
    stressed = run([0.40, 0.50], "maximize", fixed=False)
    short, reached = run([0.41, 0.30], "maximize", fixed=True), run([0.41, 0.52], "maximize", fixed=True)
    out = judge_many_records(stressed, [short, reached], names=["short", "reached"])
    by_name = {r["name"]: r for r in out["candidates"]}
    assert out["reached_target"] == ["reached"] and by_name["reached"]["knowledge_expansive"] == "yes"
    assert (by_name["short"]["knowledge_expansive"], by_name["short"]["reached_by"]) == ("not yet", ["reached"])
    assert "below the target (the stressed run's final eval_reward 0.5)" in by_name["short"]["knowledge_note"]


# --- configuration and the callbacks' source ------------------------------------------------------------


@pytest.mark.parametrize("objective, message", [
    ({"direction": "max"}, r"'objective.direction' must be one of 'minimize', 'maximize' or null, got 'max'"),
    ({"metric": " "}, r"'objective.metric' must name a metric or be null \(the integration's default\), got ' '"),
    ({"metric": 3}, r"'objective.metric' must be a string or null, got 3"),
    ({"sign": -1}, r"unknown key 'objective.sign'; allowed keys: metric, direction"),
])
def test_a_bad_objective_is_a_config_error_naming_the_value(objective, message):
    with pytest.raises(ConfigError, match=message):
        AtlasConfig.from_dict({"objective": objective})


def test_the_default_direction_of_a_metric():
    maximised = ["eval_reward", "reward", "eval_rewards/letters/mean", "val_acc", "val/accuracy", "eval_prose_accuracy"]
    minimised = ["eval_loss", "val/loss", "eval_reward_loss", "eval_kl", "perplexity", None]
    assert {default_direction(m) for m in maximised} == {"maximize"}
    assert {default_direction(m) for m in minimised} == {"minimize"}
    assert AtlasConfig.from_dict({"objective": {"direction": "minimize"}}).objective.direction_for("eval_reward") == \
        "minimize"
    assert AtlasConfig().to_dict()["objective"] == {"metric": None, "direction": None}


def test_the_source_reads_the_named_metric_and_its_direction():
    keys = {"evaluation": ("eval_loss",)}
    assert LossSource(keys).direction == "minimize"
    named = LossSource(keys, objective=ObjectiveConfig(metric="eval_reward"))
    assert (named.names("evaluation"), named.direction) == (("eval_reward",), "maximize")
    assert LossSource(keys, "eval_reward", objective=ObjectiveConfig(metric="eval_reward")).loss_key == "eval_reward"
    with pytest.raises(ConfigError, match=r"loss_key 'eval_reward' and 'objective.metric' 'eval_acc' name different"):
        LossSource(keys, "eval_reward", objective=ObjectiveConfig(metric="eval_acc"))


def test_a_named_metric_that_was_not_logged_is_an_error_and_a_default_one_a_warning():
    logged = {"eval_loss": 0.02, "eval_runtime": 0.1}
    with pytest.raises(MissingObjectiveError, match=r"the objective 'eval_reward' is not among the metrics the "
                                                    r"evaluation logged \[eval_loss, eval_runtime\]"):
        LossSource({"evaluation": ("eval_loss",)}, "eval_reward").read(logged, "evaluation", strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert LossSource({"evaluation": ("eval_reward",)}).read(logged, "evaluation", strict=True) is None
    assert "no evaluation loss for the gate: any of eval_reward is not among the logged metrics" in str(caught[0].message)
