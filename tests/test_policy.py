"""Gate policy: the paper's runs replayed, staged-escalation properties, the margin trap, state round trips."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from atlas_tracking.config import AtlasConfig
from atlas_tracking.policy import ACTIONS, GatePolicy, GateSummary
from atlas_tracking.replay import read_gates, replay

PAPER = Path(__file__).resolve().parents[1] / "examples" / "paper_gates"
BASE = {"step": 0, "c2": 0.10, "dead_experts": 2.0, "min_entropy": 3.0, "mean_cv": 50.0, "loss": 5.0}


def test_distill640_walks_revoked_alert_prepare_intervene():
    out = replay(read_gates(PAPER / "distill640.jsonl"))
    assert [o["status"] for o in out] == ["BASELINE", "YELLOW", "YELLOW", "YELLOW", "YELLOW"]
    assert [o["stage"] for o in out] == ["baseline", "revoked", "alert", "prepare", "intervene"]
    assert [o["action"] for o in out[1:]] == [ACTIONS[s] for s in ("revoked", "alert", "prepare", "intervene")]
    assert "Revoke any success" in out[1]["action"] and "Do not clear the run" in out[2]["action"]
    assert all(o["interpretation"].startswith("Scalar improvement without geometric recovery") for o in out[2:])
    assert [a["level"] for a in out[1]["alerts"]] == ["WARN"]
    assert [a["level"] for a in out[4]["alerts"]] == ["ERROR"]
    assert out[4]["intervention"].startswith("Endpoint/adaptor regularization")
    assert any("Scalar improvement without geometric recovery" in c for c in out[4]["licensed"])


def test_sft640_resume_is_a_baseline_then_green_clean():
    out = replay(read_gates(PAPER / "sft640.jsonl"))
    assert [(o["status"], o["stage"]) for o in out] == [("BASELINE", "baseline"), ("BASELINE", "baseline"), ("GREEN", "clean")]
    assert out[1]["action"].startswith("Wait for the first post-baseline gate")
    assert out[1]["stage_before_resume"] == "baseline"
    assert [a["level"] for a in out[1]["alerts"]] == ["INFO"]
    assert any("untested" in c for c in out[1]["unlicensed"])


def test_rising_margin_alone_never_makes_green():
    policy = GatePolicy()
    policy.read(GateSummary.from_dict({**BASE, "margin": 0.009}))
    for i, margin in enumerate((0.011, 0.013, 0.020, 0.050), start=1):
        d = policy.read(GateSummary.from_dict({**BASE, "step": i, "c2": 0.0, "dead_experts": 40.0, "margin": margin,
                                               "loss": 5.0 - i}))
        assert d.status != "GREEN"


gate_st = st.fixed_dictionaries({
    "c2": st.floats(-0.2, 0.2),
    "dead_experts": st.floats(0, 50),
    "min_entropy": st.floats(1.0, 4.0),
    "mean_cv": st.floats(20, 250),
    "loss": st.one_of(st.none(), st.floats(1, 8)),
    "resume": st.booleans(),
})


def _records(gates: list[dict]) -> list[dict]:
    return [{**BASE, "resume": False}] + [{**g, "step": i + 1} for i, g in enumerate(gates)]


@settings(max_examples=200, deadline=None)
@given(st.lists(gate_st, min_size=1, max_size=12))
def test_stage_never_jumps_clean_to_intervene_and_resume_is_baseline(gates):
    out = replay(_records(gates))
    for prev, cur, rec in zip(out, out[1:], _records(gates)[1:]):
        assert not (prev["stage"] == "clean" and cur["stage"] == "intervene")
        if rec["resume"]:
            assert (cur["status"], cur["stage"]) == ("BASELINE", "baseline")
            assert cur["stage_before_resume"] == prev["stage"]


@settings(max_examples=200, deadline=None)
@given(st.lists(gate_st, min_size=1, max_size=12), st.integers(1, 3))
def test_recovery_to_clean_needs_n_recover_consecutive_recovering_gates(gates, n_recover):
    cfg = AtlasConfig.from_dict({"policy": {"n_recover": n_recover}})
    out = replay(_records(gates), cfg)
    for i, cur in enumerate(out):
        if cur["stage"] == "clean" and i > 0 and out[i - 1]["stage"] not in ("clean", "baseline"):
            run = out[i - n_recover + 1 : i]
            assert len(run) == n_recover - 1 and all(o["stage"] == "recovering" for o in run)


@settings(max_examples=150, deadline=None)
@given(st.lists(gate_st, min_size=2, max_size=12), st.data())
def test_state_roundtrip_mid_sequence_never_changes_later_decisions(gates, data):
    records = _records(gates)
    cut = data.draw(st.integers(1, len(records) - 1))
    straight = replay(records)
    policy = GatePolicy()
    for r in records[:cut]:
        policy.read(GateSummary.from_dict(r))
    restored = GatePolicy()
    restored.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    later = [restored.read(GateSummary.from_dict(r)).to_dict() for r in records[cut:]]
    for a, b in zip(later, straight[cut:]):
        assert (a["status"], a["stage"], a["action"], a["licensed"]) == (b["status"], b["stage"], b["action"], b["licensed"])


def test_paired_ci_that_straddles_zero_is_not_worsening():
    policy = GatePolicy()
    policy.read(GateSummary.from_dict(BASE))
    d = policy.read(GateSummary.from_dict({**BASE, "step": 1, "c2": 0.08, "c2_delta_ci": [-0.05, 0.01]}))
    assert (d.c2_trend, d.status) == ("stable", "GREEN")
    d = policy.read(GateSummary.from_dict({**BASE, "step": 2, "c2": 0.08, "c2_delta_ci": [-0.05, -0.01]}))
    assert (d.c2_trend, d.status) == ("worsening", "YELLOW")


def test_red_needs_worsening_degrading_and_stalling():
    policy = GatePolicy()
    policy.read(GateSummary.from_dict(BASE))
    policy.read(GateSummary.from_dict({**BASE, "step": 1, "c2": 0.0, "dead_experts": 9, "loss": 4.0}))
    d = policy.read(GateSummary.from_dict({**BASE, "step": 2, "c2": -0.05, "dead_experts": 12, "loss": 4.5}))
    assert (d.status, d.loss_trend) == ("RED", "stalling")
    assert d.interpretation.startswith("Both the scalar and structural stories are bad")
