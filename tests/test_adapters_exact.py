"""Adapters against the models' own code: active sets, recombined output, fp32 scores under bf16."""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES, capture_layers, family_model

from atlas_tracking.adapters import NoRoutedLayersError, find_routed_layers


@pytest.mark.parametrize("family", FAMILIES)
def test_active_sets_and_recombined_output_equal_the_model(family):
    model = family_model(family)
    ids = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(1))
    layers, seen = capture_layers(model, ids)
    assert layers, family
    for lay in layers:
        d = seen[lay.name]
        g = d["g"].reshape(-1, d["g"].shape[-1])
        routing = lay.routing(d["router"], g)
        model_idx = d["router"][2]
        assert [set(r) for r in routing.active.tolist()] == [set(r) for r in model_idx.tolist()]
        with torch.no_grad():
            u = lay.expert_outputs(g, routing.active)
            combined = (routing.weights.unsqueeze(-1) * u).sum(1)
            shared = lay.shared_output(g)
            if shared is not None:
                combined = combined + shared
        out = d["out"].reshape(-1, g.shape[-1])
        rel = (combined - out).norm() / out.norm()
        assert rel < 1e-5, (family, lay.name, float(rel))
        assert torch.allclose(routing.rho.sum(1), torch.ones(len(g)), atol=1e-6)
        assert torch.allclose(routing.probs.sum(1), torch.ones(len(g)), atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_scores_reproduce_the_choice_in_bf16(family):
    model = family_model(family, dtype=torch.bfloat16)
    ids = torch.randint(0, 64, (4, 24), generator=torch.Generator().manual_seed(2))
    layers, seen = capture_layers(model, ids)
    for lay in layers:
        d = seen[lay.name]
        routing = lay.routing(d["router"], d["g"].reshape(-1, d["g"].shape[-1]))
        k = lay.top_k
        ours = routing.scores.topk(k, dim=1).indices
        theirs = d["router"][2]
        kth = routing.scores.gather(1, theirs).min(1).values
        outside = routing.scores.scatter(1, theirs.long(), float("-inf")).max(1).values
        ties = kth == outside  # exact ties in the model's own scores: either choice is the model's
        same = torch.tensor([set(a) == set(b) for a, b in zip(ours.tolist(), theirs.tolist())])
        assert bool((same | ties).all()), (family, lay.name)
        assert bool((kth >= outside).all())  # the model's active set is a top-k of the fp32 scores


def test_deepseek_dense_layers_groups_and_scaling():
    model = family_model("deepseek_v3")
    layers = find_routed_layers(model)
    assert [lay.name for lay in layers] == ["model.layers.1.mlp", "model.layers.2.mlp"]  # layer 0 is dense
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    _, seen = capture_layers(model, ids)
    lay = layers[0]
    d = seen[lay.name]
    routing = lay.routing(d["router"], d["g"].reshape(-1, 32))
    n_ineligible = torch.isinf(routing.scores).sum(1)
    assert bool((n_ineligible == 4).all())  # 4 groups of 2, the best 2 groups eligible
    assert torch.allclose(routing.weights, routing.rho * 2.5, atol=1e-6)


def test_gpt_oss_router_bias_and_topk_softmax():
    model = family_model("gpt_oss")
    lay = find_routed_layers(model)[0]
    with torch.no_grad():
        lay.router.bias.zero_()
        lay.router.bias[3] = 50.0
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    _, seen = capture_layers(model, ids)
    d = seen[lay.name]
    routing = lay.routing(d["router"], d["g"].reshape(-1, 32))
    assert bool((routing.active == 3).any(1).all())
    top = routing.scores.gather(1, routing.active)
    assert torch.allclose(routing.weights, torch.softmax(top, dim=1), atol=1e-6)


def test_model_without_routed_layers_names_the_searched_classes():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(NoRoutedLayersError, match=r"no routed MoE layer found in LlamaForCausalLM.*Qwen3MoeSparseMoeBlock"):
        find_routed_layers(model)
