"""The post-training base survives resumes: every gate reports the base damage since the base (cumulative)
beside the damage since its latest baseline, and the refinement margin's occupancy ratio reads the base."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from atlas_tracking import Baseline, Canary
from atlas_tracking.artifacts.gate_report import verify
from atlas_tracking.engine.measure import measure
from atlas_tracking.gate import AtlasGate

CFG = {"receipts": {"progress": False}, "policy": {"phase": "post_training"}}


def _model() -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2))


def _nudge(model: torch.nn.Module, seed: int) -> None:
    """The same small step every time, so the weights move away from the base steadily."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("atlas")
    model = _model()
    canary = Canary.from_token_ids(np.arange(3000) % 64, window=32, n_windows=8, seed=0)
    gate = AtlasGate(model, canary, CFG, out_dir=out)
    records = [gate.run(step=0, loss=4.0)]
    _nudge(model, 1)
    records.append(gate.run(step=10, loss=3.9))
    state = gate.state_dict()
    # a restart: a new gate object resumes the state at step 10; the next gate is a resume baseline
    gate = AtlasGate(model, canary, CFG, out_dir=out)
    gate.resume(10, state)
    _nudge(model, 1)
    records.append(gate.run(step=20, loss=3.8))
    _nudge(model, 1)
    records.append(gate.run(step=30, loss=3.7))
    return model, canary, out, records


def test_the_base_is_kept_across_a_resume(run):
    _, _, _, records = run
    assert [r["status"] == "BASELINE" for r in records] == [True, False, True, False]
    assert records[2]["resume"] and records[3]["baseline_step"] == 20
    assert records[1]["base_step"] == 0 and records[3]["base_step"] == 0


def test_before_a_resume_the_damage_since_the_base_is_the_damage_since_the_baseline(run):
    r = run[3][1]
    assert r["kl_base_cumulative"] == r["kl_base"] and r["canary_nll_delta_cumulative"] == r["canary_nll_delta"]
    assert r["kl_base_cumulative_ci"] == r["kl_base_ci"]


def test_after_a_resume_the_damage_since_the_base_accumulates(run):
    model, canary, out, records = run
    base, resume, now = records[0], records[2], records[3]
    # canary NLL since the base: now minus at the base, by plain arithmetic on the records
    assert now["canary_nll_delta_cumulative"] == pytest.approx(now["canary_nll"] - base["canary_nll"], abs=1e-9)
    assert now["canary_nll_delta"] == pytest.approx(now["canary_nll"] - resume["canary_nll"], abs=1e-9)
    lo, hi = now["canary_nll_delta_cumulative_ci"]
    assert lo <= now["canary_nll_delta_cumulative"] <= hi
    # the KL since the base equals a separate measurement of the same weights against the base alone
    alone = measure(model, canary, baseline=Baseline.load(out / "baselines" / base_dir(out, 0)),
                    config=CFG).drift
    assert now["kl_base_cumulative"] == pytest.approx(alone["kl_base"], rel=1e-5, abs=1e-8)
    assert now["kl_base_cumulative"] > now["kl_base"] > 0
    # the refinement margin reads the base: its drift and occupancy against the base, as the base alone gives it
    assert now["refine_reference"] == "the post-training base (step 0)"
    assert now["refine_margin"] == pytest.approx(alone["refine_margin"], abs=1e-6)
    assert records[1]["refine_reference"] == "the post-training base (step 0)"
    # the predicates read the same numbers
    assert now["predicates"]["base_damage"]["kl"] == now["kl_base_cumulative"]
    assert now["predicates"]["protected_rewrite"]["margin"] == now["refine_margin"]
    assert records[2]["predicates"] is None  # the resume baseline


def test_the_artifact_with_the_base_verifies(run):
    from atlas_tracking.artifacts.gate_report import read_artifact

    _, _, out, _ = run
    data = read_artifact(out / "receipts" / "step_00000030.json")
    assert data["drift"]["base"]["step"] == 0
    assert verify(data) == []
    data["drift"]["kl_base_cumulative"] += 0.01
    assert any("kl_base_cumulative" in p for p in verify(data))


def base_dir(out, step: int) -> str:
    """The directory name of the baseline saved at ``step`` (one per step and branch)."""
    names = sorted(p.name for p in (out / "baselines").iterdir() if p.name.startswith(f"step_{step:08d}"))
    assert len(names) == 1, names
    return names[0]
