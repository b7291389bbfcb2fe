"""Megatron-Core: the adapter's selection equals moe_utils.topk_routing_with_score_function (CPU);
a full MoELayer forward with the adapter attached (CUDA only: Megatron's gating moves weights to the GPU)."""

from __future__ import annotations

import zlib

import pytest
import torch

moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")

from atlas_tracking.integrations.megatron import RouterSpec, megatron_selection  # noqa: E402

CASES = {
    "softmax_post": RouterSpec(topk=2),
    "softmax_pre": RouterSpec(topk=2, pre_softmax=True),
    "softmax_scaled": RouterSpec(topk=3, scaling_factor=2.0),
    "sigmoid_bias": RouterSpec(topk=2, score_function="sigmoid"),
    "sigmoid_bias_groups": RouterSpec(topk=4, score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5),
    "softmax_groups": RouterSpec(topk=2, num_groups=4, group_topk=2),
    "softmax_pre_groups": RouterSpec(topk=4, pre_softmax=True, num_groups=2, group_topk=1),
    "sigmoid_top1": RouterSpec(topk=1, score_function="sigmoid"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_selection_matches_megatron(name):
    spec = CASES[name]
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    logits = torch.randn(64, 8, generator=gen)
    if spec.score_function == "sigmoid":
        spec.expert_bias = 0.1 * torch.randn(8, generator=gen)
    probs, routing_map = moe_utils.topk_routing_with_score_function(
        logits, spec.topk, use_pre_softmax=spec.pre_softmax, num_groups=spec.num_groups, group_topk=spec.group_topk,
        scaling_factor=spec.scaling_factor, score_function=spec.score_function, expert_bias=spec.expert_bias)
    routing = megatron_selection(logits, spec)
    ours = torch.zeros_like(routing_map).scatter_(1, routing.active, True)
    assert torch.equal(ours, routing_map)
    assert torch.allclose(routing.weights, probs.gather(1, routing.active), atol=1e-6)
    kth = routing.scores.gather(1, routing.active).min(1).values
    outside = routing.scores.scatter(1, routing.active, float("-inf")).max(1).values
    assert bool((kth >= outside).all())  # the active set is the top-k of the selection scores
    if spec.group_topk:
        assert bool((torch.isinf(routing.scores).sum(1) == 8 - 8 // spec.num_groups * spec.group_topk).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Megatron-Core's router gating needs CUDA")
def test_full_moe_layer_forward_matches_the_adapter():
    import os

    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from atlas_tracking.adapters import find_routed_layers

    if not torch.distributed.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2,
                            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                            moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.0,
                            moe_router_load_balancing_type="none", moe_token_dispatcher_type="alltoall",
                            add_bias_linear=False, normalization="RMSNorm", bf16=False, params_dtype=torch.float32)
    layer = build_module(get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False), config=cfg,
                         layer_number=1).cuda().eval()
    with torch.no_grad():
        layer.mlp.router.weight.normal_(0, 0.5)
        layer.mlp.router.expert_bias.normal_(0, 0.1)
    (adapter,) = find_routed_layers(torch.nn.ModuleDict({"layer": layer}))
    seen = {}
    hs = [adapter.norm.register_forward_hook(lambda m, i, o: seen.update(g=o)),
          adapter.router.register_forward_hook(lambda m, i, o: seen.update(r=o)),
          adapter.block.register_forward_hook(lambda m, i, o: seen.update(out=o[0]))]
    x = torch.randn(16, 2, 64, device="cuda")
    with torch.no_grad():
        layer(x, attention_mask=None)
    for h in hs:
        h.remove()
    g = seen["g"].reshape(-1, 64)
    routing = adapter.routing(seen["r"], g)
    with torch.no_grad():
        combined = (routing.weights.unsqueeze(-1) * adapter.expert_outputs(g, routing.active)).sum(1)
    out = seen["out"].reshape(-1, 64)
    assert (combined - out).norm() / out.norm() < 1e-5
