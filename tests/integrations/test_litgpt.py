"""LitGPT's ``LLaMAMoE`` inside a real LitGPT ``GPT``: the same exactness checks as every transformers family.

Three tiny configs cover the block's variants: Mixtral-style (plain linear router, top-k then softmax),
Qwen3-MoE-style with a zero-centred ``(1 + w)`` RMSNorm gain, a LayerNorm config (mean-centred, with a bias),
and DeepSeek-style (``GroupedTopkRouter``:
sigmoid + correction bias in the best groups, masked experts filled with 0; shared expert; scaling; a dense
first layer). The model is also found through a Fabric wrapper, as LitGPT's training scripts hold it.
"""

from __future__ import annotations

import pytest
import torch

from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.testing.families import check_bf16, check_exact, check_measure, spread

litgpt = pytest.importorskip("litgpt.model")

COMMON = dict(n_layer=2, n_embd=32, n_head=4, n_query_groups=2, vocab_size=64, padded_vocab_size=64, block_size=64,
              mlp_class_name="LLaMAMoE", n_expert=8, n_expert_per_token=2, intermediate_size=48,
              moe_intermediate_size=24, norm_class_name="RMSNorm", bias=False, parallel_residual=False,
              rotary_percentage=1.0)
VARIANTS = {
    "mixtral": {},
    "unit-offset-norm": dict(norm_class_name="RMSNorm"),
    "layernorm": dict(norm_class_name="LayerNorm"),
    "deepseek": dict(n_layer=3, n_expert_groups=4, n_topk_groups=2, n_topk_scores_per_group=2, n_shared_expert=1,
                     routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1),
}


def litgpt_forward(model, ids):
    return model(ids)


def litgpt_model(variant: str, seed: int = 0):
    from litgpt.config import Config

    torch.manual_seed(seed)
    model = litgpt.GPT(Config(**{**COMMON, **VARIANTS[variant]})).eval()
    layers = find_routed_layers(model)
    spread(layers)
    if variant == "unit-offset-norm":
        with torch.no_grad():
            for lay in layers:
                lay.norm.add_unit_offset = True
                lay.norm.weight.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_litgpt_moe_is_read_exactly(variant):
    model = litgpt_model(variant)
    layers = find_routed_layers(model)
    assert {lay.family for lay in layers} == {"litgpt"}
    assert layers[0].name == ("transformer.h.1.mlp" if variant == "deepseek" else "transformer.h.0.mlp")
    check_exact(f"litgpt-{variant}", model, litgpt_forward)
    check_measure(model, litgpt_forward)
    check_bf16(f"litgpt-{variant}", model, litgpt_forward)


def test_group_limited_choice_fills_masked_experts_with_zero_and_scales():
    model = litgpt_model("deepseek")
    lay = find_routed_layers(model)[0]
    g = torch.randn(40, 32)
    routing = lay.route(g)
    assert not torch.isinf(routing.scores).any()  # LitGPT fills masked experts with 0, so they stay competitors
    weights, index = lay.router(g)
    assert torch.equal(routing.active, index)
    assert torch.allclose(routing.weights, weights * 2.5)


def test_found_through_a_fabric_wrapper():
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    wrapped = fabric.setup_module(litgpt_model("mixtral"))
    assert [lay.name for lay in find_routed_layers(wrapped)] == ["_forward_module.transformer.h.0.mlp",
                                                                 "_forward_module.transformer.h.1.mlp"]


def test_layernorm_config_is_read_on_the_layernorm_state():
    layers = find_routed_layers(litgpt_model("layernorm"))
    assert {lay.norm_type for lay in layers} == {"layernorm"}
    assert all(lay.beta() is not None and bool(lay.beta().abs().gt(0).any()) for lay in layers)


@pytest.mark.slow
def test_the_lightning_example_fine_tunes_with_gates(tmp_path, script):
    import json

    from atlas_tracking.artifacts.gate_report import read_artifact, verify

    main = script("examples/litgpt_lightning.py").main

    gates = main(["--out", str(tmp_path), "--steps", "20", "--pretrain-steps", "10"])
    records = [json.loads(line) for line in gates.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 5, 10, 15, 20] and records[0]["status"] == "BASELINE"
    receipts = sorted((tmp_path / "atlas" / "receipts").glob("*.json"))
    data = read_artifact(receipts[-1])
    assert data["model"]["families"] == ["litgpt"] and verify(data) == []
