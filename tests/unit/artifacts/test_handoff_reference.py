"""A declared healthy reference for the handoff margin: a receipts artifact of another run, a baseline
directory, or a pinned gate of this run; a reference of another layout or canary is refused when the gate is built."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from atlas_tracking import Canary
from atlas_tracking.artifacts.gate_report import read_artifact
from atlas_tracking.artifacts.handoff_reference import HandoffReference, HandoffReferenceError
from atlas_tracking.gate import AtlasGate

PRE = {"receipts": {"progress": False}, "policy": {"phase": "pretraining"}}


def _model(seed: int = 0, layers: int = 4, experts: int = 8) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=experts, num_experts_per_tok=2))


def _canary(seed: int = 0) -> Canary:
    return Canary.from_token_ids(np.arange(3000) % 64, window=32, n_windows=8, seed=seed)


def _handoff_reference_loop(layers: list[dict], ref: list[dict], protected: list[int], n_tokens: int) -> float:
    """Eq. 31 in a loop: min over protected layers of (c2 - c2_ref) + 0.1 (rho - 1), rho with one token of
    smoothing on both sides."""
    worst = float("inf")
    for i in protected:
        rho = (layers[i]["pi_min"] + 1 / n_tokens) / (ref[i]["pi_min"] + 1 / n_tokens)
        worst = min(worst, (layers[i]["c2"] - ref[i]["c2"]) + 0.1 * (rho - 1))
    return worst


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """A receipts artifact of another model of the family on the same canary: the declared healthy reference."""
    out = tmp_path_factory.mktemp("healthy")
    AtlasGate(_model(seed=7), _canary(), PRE, out_dir=out).run(step=0)
    return out / "receipts" / "step_00000000.json"


def test_the_margin_reads_the_declared_reference_and_the_record_names_it(healthy, tmp_path):
    model = _model()
    gate = AtlasGate(model, _canary(), {**PRE, "lifecycle": {"handoff_reference": str(healthy)}}, out_dir=tmp_path)
    records = [gate.run(step=s) for s in (0, 10, 20)]
    ref = read_artifact(healthy)["layers"]
    assert all(r["handoff_reference"] == str(healthy) for r in records)
    for r in records[1:]:
        data = read_artifact(tmp_path / "receipts" / f"step_{r['step']:08d}.json")
        now = [layer["receipts"] for layer in data["layers"]]
        protected = [layer["ordinal"] for layer in data["layers"] if layer["protected"]]
        expected = _handoff_reference_loop(now, [layer["receipts"] for layer in ref], protected, 8 * 32)
        assert r["handoff_margin"] == pytest.approx(expected, abs=1e-9)
        assert r["handoff"]["reference"] == str(healthy)
        assert r["handoff"]["basis"].startswith("handoff margin >= 0 against the declared reference")


def test_without_a_reference_readiness_is_stability_only(tmp_path):
    gate = AtlasGate(_model(), _canary(), PRE, out_dir=tmp_path)
    records = [gate.run(step=s) for s in (0, 10, 20, 30)]
    assert all(r["handoff"]["basis"] == "stability only (no healthy reference declared)" for r in records)
    assert not any(r["handoff"]["ready"] for r in records)
    assert all(r["stage"] in ("baseline", "forming", "stable") for r in records)
    assert all(r["handoff"]["reasons"][-1].startswith("readiness: stability only") for r in records[1:])


def test_a_reference_on_another_canary_or_layout_is_refused_when_the_gate_is_built(healthy, tmp_path):
    # the messages name the reference, not a baseline
    with pytest.raises(HandoffReferenceError, match="canary fingerprint mismatch: reference was measured on"):
        AtlasGate(_model(), _canary(seed=3), {**PRE, "lifecycle": {"handoff_reference": str(healthy)}},
                  out_dir=tmp_path / "a")
    with pytest.raises(HandoffReferenceError, match=r"reference \(.*\) has 4 routed layers, model .* has 2"):
        AtlasGate(_model(layers=2), _canary(), {**PRE, "lifecycle": {"handoff_reference": str(healthy)}},
                  out_dir=tmp_path / "b")
    with pytest.raises(HandoffReferenceError, match=r"num_experts 8 vs 16.*\(reference vs model\)"):
        AtlasGate(_model(experts=16), _canary(), {**PRE, "lifecycle": {"handoff_reference": str(healthy)}},
                  out_dir=tmp_path / "d")
    with pytest.raises(HandoffReferenceError, match="not valid JSON"):
        bad = tmp_path / "bad.json"
        bad.write_text('{"kind": "atlas-rec')
        AtlasGate(_model(), _canary(), {**PRE, "lifecycle": {"handoff_reference": str(bad)}}, out_dir=tmp_path / "c")


def test_a_baseline_directory_is_a_reference_too(tmp_path):
    out = tmp_path / "run"
    AtlasGate(_model(seed=7), _canary(), PRE, out_dir=out).run(step=0)
    directory = next((out / "baselines").iterdir())
    ref = HandoffReference.load(directory)
    assert ref.step == 0 and len(ref.layers) == 4 and ref.layers[0]["c2"] is not None


def test_a_pinned_gate_of_this_run_becomes_the_reference_once_it_has_run(tmp_path):
    gate = AtlasGate(_model(), _canary(), {**PRE, "lifecycle": {"handoff_reference": "gate:10"}}, out_dir=tmp_path)
    records = [gate.run(step=s) for s in (0, 10, 20)]
    assert [r.get("handoff_reference") for r in records] == [None, None, str(tmp_path / "receipts" /
                                                                               "step_00000010.json")]
    assert records[1]["handoff"]["basis"] == "stability only (no healthy reference declared)"
    pinned = [layer["receipts"] for layer in read_artifact(records[2]["handoff_reference"])["layers"]]
    now = [layer["receipts"] for layer in read_artifact(tmp_path / "receipts" / "step_00000020.json")["layers"]]
    protected = [layer["ordinal"] for layer in records[2]["layers"] if layer["protected"]]
    assert records[2]["handoff_margin"] == pytest.approx(_handoff_reference_loop(now, pinned, protected, 256), abs=1e-9)
