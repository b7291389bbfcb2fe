"""Gate policy: the paper's runs replayed, staged-escalation properties, the margin trap, state round trips."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from atlas_tracking.decisions.policy import ACTIONS, INTERVENTIONS, GatePolicy, GateSummary
from atlas_tracking.decisions.replay import read_gates, replay
from atlas_tracking.schema.config import AtlasConfig

PAPER = Path(__file__).resolve().parents[3] / "examples" / "paper_gates"
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
    assert out[4]["intervention"] == INTERVENTIONS["overlap_and_occupancy"]
    assert "load-balancing (router prior) loss weight five-fold" in out[4]["intervention"]
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
@given(st.lists(gate_st, min_size=2, max_size=12), st.data(), st.sampled_from(["auto", "pretraining", "post_training"]))
def test_state_roundtrip_mid_sequence_never_changes_later_decisions(gates, data, phase):
    cfg = AtlasConfig.from_dict({"policy": {"phase": phase}})
    records = _records(gates)
    cut = data.draw(st.integers(1, len(records) - 1))
    straight = replay(records, cfg)
    policy = GatePolicy(cfg)
    for r in records[:cut]:
        policy.read(GateSummary.from_dict(r))
    restored = GatePolicy(cfg)
    restored.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    later = [restored.read(GateSummary.from_dict(r)).to_dict() for r in records[cut:]]
    for a, b in zip(later, straight[cut:]):
        assert (a["status"], a["stage"], a["action"], a["licensed"], a["phase"], a["handoff"]) == (
            b["status"], b["stage"], b["action"], b["licensed"], b["phase"], b["handoff"])


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


# --- post-training: the same occupancy pathology (Table 13) --------------------------------------


def test_c2_worsening_with_healthy_occupancy_never_escalates_to_intervene():
    # A resumed run whose C2 falls gate after gate while occupancy gets healthier (min entropy up, CV down
    # 81.8 -> 61.1): Table 11's "atlas motion without occupancy collapse", never "the same occupancy pathology".
    gates = [{**BASE, "step": 0, "c2": 0.10, "min_entropy": 2.0, "mean_cv": 81.8}]
    for i, (c2, h, cv) in enumerate([(0.08, 2.05, 75.0), (0.06, 2.1, 70.0), (0.04, 2.2, 66.0), (0.02, 2.3, 61.1),
                                     (0.0, 2.3, 61.1)], start=1):
        gates.append({**BASE, "step": 100 * i, "c2": c2, "min_entropy": h, "mean_cv": cv, "loss": 5.0 - 0.1 * i,
                      "c2_delta_ci": [c2 - 0.12, c2 - 0.11], "min_entropy_delta_ci": [0.01, 0.4],
                      "mean_cv_delta_ci": [-25.0, -5.0]})
    out = replay(gates)
    assert [o["occupancy"] for o in out[1:]] == ["healthy"] * 5
    assert [o["stage"] for o in out[1:]] == ["revoked"] * 5
    assert [a["level"] for o in out for a in o["alerts"]] == ["WARN"]
    assert out[-1]["interpretation"].startswith("Atlas motion is visible without occupancy collapse")
    assert out[-1]["intervention"] == INTERVENTIONS["atlas_drift"]


def test_a_flat_degraded_plateau_stays_on_alert_and_never_intervenes():
    # Table 13 asks for two subsequent *worse* gates; a persistent bad plateau is Table 11's "investigate".
    flat = {"c2": 0.02, "dead_experts": 9.0, "mean_cv": 80.0}
    out = replay([BASE] + [{**BASE, "step": s, **flat} for s in (1, 2, 3, 4, 5)])
    assert [o["stage"] for o in out] == ["baseline", "revoked", "alert", "alert", "alert", "alert"]
    assert [a["level"] for o in out for a in o["alerts"]] == ["WARN"]
    assert out[2]["rule"].startswith("Table 11 row 2") and "investigate" in out[2]["rule"]
    # two further worse gates with the same pathology do intervene
    worse = [{**BASE, "step": 6, "c2": 0.01, "dead_experts": 10.0, "mean_cv": 80.0},
             {**BASE, "step": 7, "c2": 0.0, "dead_experts": 11.0, "mean_cv": 80.0}]
    out = replay([BASE] + [{**BASE, "step": s, **flat} for s in (1, 2, 3)] + worse)
    assert [o["stage"] for o in out[-2:]] == ["prepare", "intervene"]
    assert out[-1]["rule"] == "Table 13 row 3: two subsequent worse gates with the same occupancy pathology"


def test_a_red_first_bad_gate_never_says_intervene_beside_revoke():
    red = {**BASE, "step": 1, "c2": 0.0, "dead_experts": 9.0, "mean_cv": 80.0, "loss": 5.0}
    out = replay([BASE, red, {**red, "step": 2, "loss": 5.0}])
    assert (out[1]["status"], out[1]["stage"]) == ("RED", "revoked")
    assert "Intervene or reset" not in out[1]["interpretation"]
    assert "collect the next gate" in out[1]["interpretation"] and "Keep the next gate" in out[1]["action"]
    assert out[1]["rule"] == "Table 13 row 1: first bad gate after a clean baseline"


def test_every_post_training_transition_names_its_table_row():
    out = replay(read_gates(PAPER / "distill640.jsonl"))
    assert [o["rule"].split(":")[0] for o in out] == ["Table 13 row 4", "Table 13 row 1", "Table 13 row 2",
                                                      "Table 13 row 3", "Table 13 row 3"]


def test_escalation_needs_occupancy_degrading_at_consecutive_gates():
    worse = {"dead_experts": 9.0, "mean_cv": 80.0}
    gates = [BASE, {**BASE, "step": 1, "c2": 0.05},                       # C2 alone: revoked
             {**BASE, "step": 2, "c2": 0.04, **worse},                    # pathology appears: not yet "the same"
             {**BASE, "step": 3, "c2": 0.03, **worse},                    # again: prepare
             {**BASE, "step": 4, "c2": 0.02, **worse}]                    # and again: intervene
    assert [o["stage"] for o in replay(gates)] == ["baseline", "revoked", "revoked", "prepare", "intervene"]


# --- pretraining: the forming atlas and handoff readiness (Table 10) ------------------------------

PRE = AtlasConfig.from_dict({"policy": {"phase": "pretraining", "c2_tol": 0.01, "dead_tol": 1.0,
                                        "entropy_tol": 0.1, "cv_tol": 10.0}})


def _layers(dead: float = 2, entropy: float = 3.3, v2_pass: bool = True) -> list[dict]:
    return [{"name": f"l{i}", "ordinal": i, "protected": i in (1, 2), "num_experts": 32, "top_k": 2, "c2": 0.1,
             "dead_experts": dead, "router_entropy": entropy, "v2_c1_pass": v2_pass} for i in range(4)]


def _pre(step: int, c2: float, dead: float, h: float, cv: float, **kw) -> dict:
    """A pretraining gate whose routed layers are above the readiness floor (exp(3.3) = 27 of 32 effective
    experts), with the handoff margin +0.01 against a declared healthy reference unless ``kw`` says otherwise."""
    return {"step": step, "c2": c2, "c2_protected": c2, "dead_experts": dead, "min_entropy": h, "mean_cv": cv,
            "loss": 5.0 - step / 1000, "handoff_margin": 0.01, "handoff_reference": "healthy.json",
            "layers": _layers(dead), **kw}


def test_pretraining_rolls_the_reference_and_never_escalates():
    # The forming atlas of early pretraining: usage narrows and C2 moves a lot between gates.
    gates = [_pre(0, 0.00, 0, 3.4, 40), _pre(200, 0.15, 4, 2.4, 150), _pre(400, 0.12, 6, 2.2, 170),
             _pre(600, 0.09, 8, 2.0, 190)]
    out = replay(gates, PRE)
    assert [(o["phase"], o["status"], o["stage"]) for o in out] == [
        ("pretraining", "BASELINE", "baseline")] + [("pretraining", "GREEN", "forming")] * 3
    assert [o["handoff"]["reference_step"] for o in out[1:]] == [0, 200, 400]
    assert [a for o in out for a in o["alerts"]] == []
    assert all(not o["handoff"]["ready"] and o["handoff"]["reasons"] for o in out)
    assert "moved since step 400: C2, dead experts, min entropy, mean CV" in out[3]["handoff"]["reasons"][0]
    assert any("Preservation of the atlas" in c for c in out[3]["unlicensed"])


def test_handoff_ready_after_n_stable_gates_then_lost_when_the_atlas_moves():
    gates = [_pre(0, 0.10, 4, 2.5, 150), _pre(200, 0.104, 4.5, 2.45, 152), _pre(400, 0.107, 4.5, 2.5, 149),
             _pre(600, 0.108, 5, 2.48, 151), _pre(800, 0.06, 5, 2.48, 151)]
    out = replay(gates, PRE)
    assert [o["stage"] for o in out] == ["baseline", "forming", "ready", "ready", "forming"]
    assert out[1]["handoff"]["reasons"] == ["atlas not yet stable: 1 of 2 consecutive stable gates",
                                            "handoff margin +0.0100 against healthy.json: 1 of 2 consecutive gates >= 0"]
    assert out[2]["handoff"] == {
        "ready": True, "stable_gates": 2, "n_stable": 2, "margin": 0.01, "margin_gates": 2, "reference": "healthy.json",
        "basis": "handoff margin >= 0 against the declared reference healthy.json at 2 consecutive gates, with stability",
        "reference_step": 200, "reasons": []}
    assert [(a["level"], a["key"]) for o in out for a in o["alerts"]] == [("INFO", "stage:ready")]
    assert out[4]["handoff"]["reasons"][0].startswith("atlas not yet stable: 0 of 2")
    assert "C2 falling on the protected layers: 0.1080 -> 0.0600 since step 600" in out[4]["handoff"]["reasons"]


def test_readiness_needs_v2_c1_on_every_protected_layer():
    gates = [_pre(0, 0.10, 4, 2.5, 150)] + [_pre(s, 0.10, 4, 2.5, 150) for s in (200, 400)]
    gates[2]["layers"][2]["v2_c1_pass"] = False
    out = replay(gates, PRE)
    assert out[2]["handoff"]["reasons"] == [
        "V2 C1 does not pass on protected layer(s) l2 (boundary swaps not gentler than interior ones)"]


def test_occupancy_collapse_is_yellow_with_a_warn_in_pretraining():
    collapsed = _pre(400, 0.02, 4, 2.5, 400)
    collapsed["layers"][1].update(dead_experts=28, router_entropy=0.9)
    out = replay([_pre(0, 0.10, 4, 2.5, 150), _pre(200, 0.10, 4, 2.5, 150), collapsed], PRE)
    assert (out[2]["status"], out[2]["stage"]) == ("YELLOW", "collapse")
    assert out[2]["collapse"] == ["l1: 28 of 32 experts dead (more than 0.75 of them)",
                                  "l1: effective experts exp(H) = 2.46 < 2 x top-k 2"]
    assert [(a["level"], a["title"]) for a in out[2]["alerts"]] == [("WARN", "atlas: occupancy collapse at step 400")]
    assert out[2]["intervention"] == INTERVENTIONS["collapse"]


def test_readiness_without_a_declared_reference_is_stability_only_never_ready():
    gates = [_pre(s, 0.10, 4, 3.3, 150, handoff_reference=None, handoff_margin=0.0) for s in (0, 200, 400, 600)]
    out = replay(gates, PRE)
    assert [o["stage"] for o in out] == ["baseline", "forming", "stable", "stable"]
    assert not any(o["handoff"]["ready"] for o in out)
    assert out[3]["handoff"]["basis"] == "stability only (no healthy reference declared)"
    assert out[3]["handoff"]["reasons"] == [
        "readiness: stability only (no healthy reference declared; set lifecycle.handoff_reference)"]
    assert [a for o in out for a in o["alerts"]] == []
    assert "declare a healthy reference" in out[3]["action"]


def test_a_slow_steady_decline_of_c2_is_never_ready_against_a_healthy_reference():
    # Each gate-to-gate C2 step (0.004) is inside c2_tol (0.01), so the atlas reads "stable" gate to gate; the
    # handoff margin against the declared healthy reference (C2 0.10) keeps falling below 0.
    gates = [_pre(200 * i, 0.10 - 0.004 * i, 4, 3.3, 150, handoff_margin=-0.004 * i) for i in range(8)]
    out = replay(gates, PRE)
    assert all(o["handoff"]["stable_gates"] >= 2 for o in out[2:])
    assert [o["stage"] for o in out[2:]] == ["forming"] * 6
    assert out[7]["handoff"]["reasons"] == [
        "handoff margin -0.0280 against healthy.json: 0 of 2 consecutive gates >= 0"]


def test_a_layer_with_most_experts_dead_is_not_ready_though_not_collapsed():
    def gate(step: int) -> dict:
        g = _pre(step, 0.10, 4, 3.3, 150)
        g["layers"][1].update(dead_experts=20, router_entropy=2.4)  # 20 of 32 dead: under the 0.75 collapse floor
        return g

    out = replay([gate(s) for s in (0, 200, 400, 600)], PRE)
    assert [o["stage"] for o in out] == ["baseline", "forming", "forming", "forming"]
    assert out[3]["collapse"] == []
    assert out[3]["handoff"]["reasons"] == [
        "occupancy below the readiness floor: l1: 20 of 32 experts dead (more than 0.25 of them); "
        "l1: effective experts exp(H) = 11.02 < 0.5 x 32 experts"]


# --- which phase --------------------------------------------------------------------------------


def test_auto_phase_from_the_first_gate_canary_nll_against_ln_vocab():
    fresh = replay([{**BASE, "canary_nll": 5.40, "vocab_size": 256}])[0]
    trained = replay([{**BASE, "canary_nll": 1.38, "vocab_size": 256}])[0]
    unknown = replay([BASE])[0]
    assert (fresh["phase"], trained["phase"], unknown["phase"]) == ("pretraining", "post_training", "post_training")
    assert "5.400 >= 0.9 x ln(256) = 4.991" in fresh["phase_source"]
    assert unknown["phase_source"].startswith("default")


def test_resume_with_an_explicit_post_training_phase_is_the_handoff():
    policy = GatePolicy(PRE)
    for g in (_pre(0, 0.1, 4, 2.5, 150), _pre(200, 0.1, 4, 2.5, 150)):
        policy.read(GateSummary.from_dict(g))
    state = json.loads(json.dumps(policy.state_dict()))
    assert state["phase"] == "pretraining"
    after = GatePolicy(AtlasConfig.from_dict({"policy": {"phase": "post_training"}}))
    after.load_state_dict(state)
    assert not after.rolls_reference
    # A gate the old run recorded after its checkpoint is caught up in the phase it states, not re-based.
    caught = after.read(GateSummary.from_dict({**_pre(300, 0.1, 4, 2.5, 150), "phase": "pretraining"}))
    assert (caught.phase, caught.status, caught.stage) == ("pretraining", "GREEN", "ready")
    d = after.read(GateSummary.from_dict({**BASE, "step": 400, "resume": True}))
    assert (d.status, d.phase, d.phase_before_resume, d.stage_before_resume) == (
        "BASELINE", "post_training", "pretraining", "ready")
    assert after.read(GateSummary.from_dict({**BASE, "step": 600, "c2": 0.0})).stage == "revoked"
    kept = GatePolicy()  # phase auto keeps the restored phase through a resume
    kept.load_state_dict(state)
    assert kept.rolls_reference and kept.read(GateSummary.from_dict({**BASE, "step": 400, "resume": True})).phase == (
        "pretraining")


def test_replay_honours_the_phase_each_record_states():
    records = [{**_pre(0, 0.1, 4, 2.5, 150), "phase": "pretraining"}, _pre(200, 0.0, 9, 2.0, 190),
               {**BASE, "step": 400, "resume": True, "phase": "post_training"}, {**BASE, "step": 600, "c2": 0.0}]
    out = replay(records)
    assert [(o["phase"], o["stage"]) for o in out] == [("pretraining", "baseline"), ("pretraining", "forming"),
                                                       ("post_training", "baseline"), ("post_training", "revoked")]
    assert [a["key"] for o in out for a in o["alerts"]] == ["resume_baseline", "stage:revoked"]
    assert "Phase pretraining -> post_training" in out[2]["alerts"][0]["text"]


def test_a_changed_protected_set_compares_the_same_layers_on_both_sides():
    """``protected_layers: auto`` may change the set between two gates: the reference's protected C2 is then
    taken over this gate's layers, not its own (which would compare two different layer sets)."""
    steady = [0.30, 0.05, 0.05, 0.30]

    def gate(step: int, protected: set[int], per_layer: list[float]) -> dict:
        layers = [{"name": f"l{i}", "ordinal": i, "c2": c, "dead_experts": 4, "router_entropy": 2.5, "load_cv": 1.5,
                   "num_experts": 32, "top_k": 2, "protected": i in protected, "v2_c1_pass": True}
                  for i, c in enumerate(per_layer)]
        prot = sum(per_layer[i] for i in protected) / len(protected)
        return _pre(step, sum(per_layer) / 4, 4, 2.5, 150, c2_protected=prot, layers=layers)

    out = replay([gate(0, {0, 3}, steady), gate(200, {0, 3}, steady), gate(400, {1, 2}, steady)], PRE)
    # nothing moved: the per-layer C2 is the same at every gate, only the protected set changed at 400
    assert not any("C2 falling" in r for o in out[1:] for r in o["handoff"]["reasons"])
    # the same change with the newly protected layers' C2 really falling is still named
    out = replay([gate(0, {0, 3}, steady), gate(200, {1, 2}, [0.30, 0.01, 0.01, 0.30])], PRE)
    assert any(r.startswith("C2 falling on the protected layers: 0.0500 -> 0.0100") for r in out[1]["handoff"]["reasons"])
