"""Top-1 routing (k = 1) read end to end: C2 absent with its reason, never 0, and the C2-free rules of the policy
(docs/policy.md#top-1-routing, docs/receipts.md#top-1-routing-and-zero-computation-experts)."""

from __future__ import annotations

import json

import pytest
import torch

from atlas_tracking import Baseline, measure
from atlas_tracking.artifacts.gate_report import verify
from atlas_tracking.artifacts.record import gate_metrics
from atlas_tracking.cli import main
from atlas_tracking.decisions.judge import judge_records
from atlas_tracking.decisions.policy import GatePolicy, GateSummary, PolicyInputError
from atlas_tracking.decisions.protection import resolve
from atlas_tracking.gate import AtlasGate
from atlas_tracking.receipts.lifecycle import occupancy_ratio
from atlas_tracking.schema.config import AtlasConfig
from atlas_tracking.testing.lightning_lm import build_qwen3_moe
from atlas_tracking.testing.tiny import QUIET, tiny_canary
from atlas_tracking.viz.gate_table import run_gates
from atlas_tracking.viz.html_report import write_report
from atlas_tracking.viz.tables import layer_table, summary_line

TOP1 = "top-1 routing"
POST = {**QUIET, "policy": {"phase": "post_training"}}
PRE = {**QUIET, "policy": {"phase": "pretraining"}}


def top1_model(seed: int = 0):
    """A tiny Qwen3-MoE with ``num_experts_per_tok = 1`` (2 routed layers, 8 experts)."""
    model = build_qwen3_moe(seed=seed, hidden=32, layers=2, experts=8, top_k=1, aux_coef=0.0).eval()
    assert model.config.num_experts_per_tok == 1
    return model


def nudge_router(model, scale: float) -> None:
    """Move every router by seeded noise of size ``scale`` (a top-1 choice, and so the expert loads, change)."""
    torch.manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            weight = layer.mlp.gate.weight
            weight.add_(torch.randn_like(weight) * scale * weight.std())


@pytest.fixture(scope="module")
def post_run(tmp_path_factory):
    """A post-training run of a top-1 model: a baseline and three gates, the router sharpened between them."""
    out = tmp_path_factory.mktemp("top1") / "atlas"
    model = top1_model()
    gate = AtlasGate(model, tiny_canary(), POST, out_dir=out)
    records = [gate.run(0, loss=4.0), gate.run(10, loss=3.9)]
    nudge_router(model, 1.0)
    records += [gate.run(20, loss=3.8), gate.run(30, loss=3.8)]
    gate.finish()
    return out, records


def test_gates_of_a_top1_model_run_with_c2_absent_and_its_reason(post_run):
    _, records = post_run
    for rec in records:
        assert rec["c2"] is None and rec["c2_min"] is None and rec["c2_protected"] is None
        assert rec["c2_absent"] == TOP1
        assert all(lay["top_k"] == 1 and lay["c2"] is None for lay in rec["layers"])
        assert rec["c2_trend"] == "n/a"
    after = records[1:]
    for rec in after:
        assert rec["c2_delta"] is None and rec["c2_delta_ci"] in (None, [None, None])
        assert all(lay["c2_delta"] is None for lay in rec["layers"])
        assert isinstance(rec["handoff_margin"], float) and isinstance(rec["refine_margin"], float)
    assert [r["status"] for r in records[:2]] == ["BASELINE", "GREEN"]
    assert records[1]["stage"] == "clean" and records[1]["handoff_margin"] == 0.0  # the same weights: rho = 1
    assert any("top-1 routing" in claim for claim in records[1]["licensed"])
    assert any("top-1 routing" in claim for claim in records[1]["unlicensed"])


def test_a_top1_gate_sends_no_c2_metric(post_run):
    _, records = post_run
    for rec in records:
        metrics = gate_metrics(rec)
        assert not [k for k in metrics if k.split("/")[-1].startswith("c2")], rec["step"]
        assert "atlas/dead_experts" in metrics and "atlas/layer_01/load_cv" in metrics


def test_verify_passes_the_receipts_of_a_top1_gate(post_run, capsys):
    out, records = post_run
    receipts = sorted((out / "receipts").glob("step_*.json"))
    assert len(receipts) == len(records)
    for path in receipts:
        assert main(["verify", str(path)]) == 0, capsys.readouterr()
        assert json.loads(path.read_text())["summary"]["c2_absent"] == TOP1


def test_views_show_na_top1_where_c2_would_be(post_run, tmp_path):
    out, records = post_run
    page = write_report(out, tmp_path / "report.html").read_text()
    assert page.count("n/a (top-1)") >= 3  # the per-layer C2, the heatmap and the gate rows
    assert 'alt="per-layer C2"' not in page and 'alt="C2 heatmap: layers x gates"' not in page
    rows = run_gates(out)["rows"]
    assert {row[2] for row in rows} == {"n/a (top-1)"} and {row[3] for row in rows} == {"n/a (top-1)"}
    assert "c2=n/a (top-1)" in summary_line(records[-1])  # the console sink's line
    receipts = sorted((out / "receipts").glob("step_*.json"))[-1]
    assert "n/a (top-1)" in layer_table(json.loads(receipts.read_text())["layers"])
    page = write_report(receipts, tmp_path / "receipts.html").read_text()
    assert "C2: n/a (top-1)" in page and 'alt="per-layer C2"' not in page


def test_replay_rederives_the_decisions_of_a_top1_run(post_run, capsys):
    out, records = post_run
    assert main(["replay", str(out / "gates.jsonl")]) == 0
    printed = capsys.readouterr().out
    assert all(r["stage"] in printed for r in records)


def test_pretraining_reads_a_top1_model_from_occupancy(tmp_path):
    model = top1_model(seed=1)
    gate = AtlasGate(model, tiny_canary(), PRE, out_dir=tmp_path / "atlas")
    records = [gate.run(step, loss=4.0 - step / 100) for step in (0, 10, 20)]
    gate.finish()
    assert [r["phase"] for r in records] == ["pretraining"] * 3
    assert all(r["c2_trend"] == "n/a" for r in records)
    for rec in records[1:]:
        assert rec["status"] == "GREEN" and rec["stage"] in ("forming", "stable")
        assert "stability read from occupancy only (top-1 routing: no C2)" in rec["handoff"]["basis"]
        assert not any("C2" in reason for reason in rec["handoff"]["reasons"])
    last = records[-1]["handoff"]  # the same weights: stable on occupancy alone for n_stable gates
    assert last["stable_gates"] == last["n_stable"] == 2
    assert not any("not yet stable" in reason for reason in last["reasons"])


def test_measure_against_a_baseline_gives_the_occupancy_only_handoff_margin():
    canary = tiny_canary()
    cfg = AtlasConfig.from_dict(QUIET)
    model = top1_model(seed=2)
    base = measure(model, canary, config=cfg)
    nudge_router(model, 1.0)
    now = measure(model, canary, baseline=Baseline.from_report(base), config=cfg)
    data = now.to_dict()
    assert verify(data) == []
    assert data["summary"]["c2"] is None and data["summary"]["c2_absent"] == TOP1
    assert data["drift"]["c2_delta"] is None
    lc, n_tokens = cfg.lifecycle, canary.n_windows * canary.window
    terms = {lay["name"]: lc.lam2 * (occupancy_ratio(lay["receipts"]["pi_min"], ref["pi_min"], n_tokens) - 1.0)
             for lay, ref in zip(now.layers, data["drift"]["handoff_reference"]) if lay["protected"]}
    assert data["drift"]["handoff_margin"] == pytest.approx(min(terms.values()), abs=1e-12)
    assert data["drift"]["handoff_layer"] == min(terms, key=terms.get)
    assert any(v != 0.0 for v in terms.values())  # the router moved: the occupancy term alone carries the margin


# --- the policy's C2-free rules, on gate summaries ------------------------------------------------------------


def top1_gate(step: int, dead: float, entropy: float, cv: float, loss: float | None) -> GateSummary:
    return GateSummary.from_dict({"step": step, "c2": None, "c2_absent": TOP1, "dead_experts": dead,
                                  "min_entropy": entropy, "mean_cv": cv, "loss": loss})


def test_occupancy_degrading_at_consecutive_top1_gates_escalates_to_intervene():
    policy = GatePolicy(AtlasConfig.from_dict({"policy": {"phase": "post_training"}}))
    rows = [(0, 0, 3.0, 140, None), (500, 10, 2.9, 150, 4.7), (1000, 12, 2.8, 160, 4.6), (1500, 14, 2.7, 170, 4.6),
            (2000, 16, 2.6, 180, 4.6)]
    decisions = [policy.read(top1_gate(*row)) for row in rows]
    assert [(d.status.value, d.stage.value) for d in decisions] == [
        ("BASELINE", "baseline"), ("YELLOW", "revoked"), ("YELLOW", "prepare"), ("YELLOW", "intervene"),
        ("RED", "intervene")]
    assert {d.c2_trend for d in decisions} == {"n/a"}
    assert decisions[2].rule.startswith("Table 13 row 3") and decisions[3].rule.startswith("Table 13 row 3")
    assert decisions[-1].interpretation.startswith("Top-1 routing (no C2): occupancy and the objective are both bad")
    assert decisions[1].intervention is not None and "narrowing of expert usage" in decisions[1].intervention


def test_a_healthy_top1_sequence_stays_green_and_recovery_reads_occupancy():
    policy = GatePolicy(AtlasConfig.from_dict({"policy": {"phase": "post_training"}}))
    healthy = [policy.read(top1_gate(s, 0, 3.0, 140, 4.5 - s / 1000)) for s in (0, 100, 200, 300)]
    assert [d.status.value for d in healthy[1:]] == ["GREEN"] * 3 and healthy[-1].stage.value == "clean"
    bad = policy.read(top1_gate(400, 10, 2.5, 200, 4.2))
    repaired = [policy.read(top1_gate(s, 0, 3.0, 140, 4.1)) for s in (500, 600)]
    assert bad.stage.value == "revoked"
    assert [d.stage.value for d in repaired] == ["recovering", "clean"]


def test_a_missing_c2_without_a_reason_is_still_an_input_error():
    with pytest.raises(PolicyInputError, match="field 'c2' is missing"):
        GateSummary.from_dict({"step": 1, "c2": None, "dead_experts": 0, "min_entropy": 3.0, "mean_cv": 140})


def test_judge_reads_two_top1_runs_from_occupancy():
    def rec(step, loss, dead, entropy, cv):
        return {"step": step, "loss": loss, "c2": None, "c2_absent": TOP1, "dead_experts": dead,
                "min_entropy": entropy, "mean_cv": cv}

    stressed = [rec(0, None, 0, 3.0, 140), rec(10, 4.7, 20, 2.3, 190), rec(20, 4.6, 22, 2.2, 195)]
    broader = [rec(0, None, 0, 3.0, 140), rec(10, 4.62, 5, 2.8, 150), rec(20, 4.6, 4, 2.85, 148)]
    result = judge_records(stressed, broader)
    state2 = next(c for c in result["checks"] if c["name"] == "state2")
    assert state2["passed"] and state2["status"] == "n/a (top-1 routing)" and state2["c2_delta"] is None
    assert result["verdict"] == "real fix"
    same = judge_records(stressed, [rec(0, None, 0, 3.0, 140), rec(10, 4.62, 20, 2.3, 190), rec(20, 4.6, 22, 2.2, 195)])
    assert same["verdict"] == "not yet" and "not_state1_only" in same["failing"]  # no C2 gain to stand in for


def test_auto_protection_stays_mid_with_the_reason_at_top1():
    lifecycle = AtlasConfig.from_dict({"lifecycle": {"protected_layers": "auto"}}).lifecycle
    layers = [{"name": f"model.layers.{i}.mlp", "ordinal": i, "c2": None, "c2_delta": None, "num_experts": 8,
               "dead_experts": 0} for i in range(4)]
    records = [{"step": s, "status": "BASELINE" if s == 0 else "GREEN", "phase": "post_training", "c2": None,
                "c2_absent": TOP1, "canary_fingerprint": "f", "layers": layers} for s in (0, 10, 20, 30)]
    chosen = resolve(records, 4, lifecycle, step=40, fingerprint="f")
    assert chosen["source"] == "mid (top-1 routing: no per-layer C2 deltas to choose from)"
    assert chosen["ordinals"] == [1, 2]
