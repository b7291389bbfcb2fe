"""DeepSpeed AutoEP on CPU: transformers MoE blocks replaced by DeepSpeed's own ``AutoEPMoELayer``.

The layers are detected and built by DeepSpeed's ``AutoEP`` (``ep_parser`` and its replacement of
each block); only its retargeting of transformers' output recorders is skipped, because on
transformers 5.23 it fails inside DeepSpeed (``auto_ep_presets/base.py``: ``_CanRecordRegistry.get()``).
"""

from __future__ import annotations

import json

import pytest
import torch

from atlas_tracking.testing.families import capture_layers, family_model

pytest.importorskip("deepspeed.module_inject.auto_ep")

from atlas_tracking import AtlasConfig, Baseline, Canary, measure
from atlas_tracking.artifacts.gate_report import verify

AUTOEP_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
"""AutoEP presets covered here: softmax (Qwen3-MoE), softmax with a gated shared expert (Qwen2-MoE),
softmax with renormalised weights (Mixtral), sigmoid with score-correction bias, group-limited choice,
scaling and a shared expert (DeepSeek-V3)."""
CFG = AtlasConfig.from_dict({"receipts": {"progress": False, "n_bootstrap": 100, "anchors": 32}})


def autoep_model(family: str):
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_presets.base import AutoEPConfig

    model = family_model(family)
    autoep = AutoEP(model, AutoEPConfig(enabled=True, autoep_size=1))
    for spec in autoep.ep_parser():
        autoep._replace_moe_layer_without_retarget(spec, ep_size=1, ep_rank=0)
    return model


@pytest.mark.parametrize("family", AUTOEP_FAMILIES)
def test_autoep_active_sets_scores_and_recombined_output(family):
    model = autoep_model(family)
    ids = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(1))
    layers, seen = capture_layers(model, ids)
    assert layers and all(type(lay.block).__name__ == "AutoEPMoELayer" for lay in layers)
    assert {lay.family for lay in layers} == {"deepspeed-autoep"}
    for lay in layers:
        d = seen[lay.name]
        g = d["g"].reshape(-1, d["g"].shape[-1])
        routing = lay.routing(d["router"], g)
        theirs = d["router"][1].long()
        assert torch.equal(routing.active, theirs)
        kth = routing.scores.gather(1, theirs).min(1).values
        outside = routing.scores.scatter(1, theirs, float("-inf")).max(1).values
        assert bool((kth >= outside).all())  # the router's choice is a top-k of our selection scores
        with torch.no_grad():
            combined = (routing.weights.unsqueeze(-1) * lay.expert_outputs(g, routing.active)).sum(1)
            shared = lay.shared_output(g)
            if shared is not None:
                combined = combined + shared
        out = d["out"].reshape(-1, g.shape[-1])
        assert (combined - out).norm() / out.norm() < 1e-5, (family, lay.name)
        assert torch.allclose(routing.rho.sum(1), torch.ones(len(g)), atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_autoep_gate_measures_verifies_and_leaves_load_statistics(family):
    model = autoep_model(family)
    blocks = [m for m in model.modules() if type(m).__name__ == "AutoEPMoELayer"]
    before = [b.tokens_per_expert.clone() for b in blocks]
    canary = Canary.from_token_ids((torch.arange(3000) * 7 % 64).numpy(), window=20, n_windows=6, seed=0)
    report = measure(model, canary, config=CFG)
    assert all(torch.equal(b.tokens_per_expert, t) for b, t in zip(blocks, before))  # the gate left no trace
    assert verify(json.loads(report.to_json())) == []
    drift = measure(model, canary, baseline=Baseline.from_report(report), config=CFG).drift
    assert all(layer[key] == 0.0 for layer in drift["layers"] for key in ("boundary_drift", "content_drift"))
