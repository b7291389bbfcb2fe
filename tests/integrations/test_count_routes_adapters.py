"""Every framework adapter's cheap count of a training forward's routes (``RoutedLayer.count_routes``, what the
counting hooks between gates read) equals the adapter's full reading of the same router call (``routing``: the
active set the gate reads, itself held to each framework's own output by the family tests), counted here in
plain Python. DeepSpeed-MoE's count, with dropped routes and expert parallelism, is held to its gate's own sparse
output in tests/e2e/test_telemetry_distributed.py; transformers families in tests/integrations/test_telemetry_callbacks.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.engine.route_counts import RouteCounter
from atlas_tracking.testing.families import spread


def counted_against_routing(model: torch.nn.Module, layers: list, run) -> int:
    """Run ``run()`` (training forwards) with the counting hooks and a capture of every router call; assert each
    layer's count equals the adapter's ``routing`` active sets of the captured calls. Returns the routes counted."""
    seen: dict[str, list] = {layer.name: [] for layer in layers}
    capture = [layer.router.register_forward_hook(
        lambda m, args, kwargs, out, name=layer.name: seen[name].append((args or tuple(kwargs.values()), out)),
        with_kwargs=True) for layer in layers]
    counter = RouteCounter(layers).attach()
    model.train()
    run()
    interval = counter.collect()
    for handle in capture:
        handle.remove()
    counter.detach()
    total = 0
    for row, layer in zip(interval.layers, layers):
        expected = [0] * layer.num_experts
        for args, out in seen[layer.name]:
            g = args[0].reshape(-1, args[0].shape[-1])
            for experts in layer.routing(out, g).active.tolist():
                for e in experts:
                    expected[e] += 1
        assert seen[layer.name] and row["load"] == expected, layer.name
        assert row["calls"] == len(seen[layer.name])
        total += sum(expected)
    return total


LITGPT = dict(n_layer=2, n_embd=32, n_head=4, n_query_groups=2, vocab_size=64, padded_vocab_size=64, block_size=64,
              mlp_class_name="LLaMAMoE", n_expert=8, n_expert_per_token=2, intermediate_size=48,
              moe_intermediate_size=24, norm_class_name="RMSNorm", bias=False, parallel_residual=False,
              rotary_percentage=1.0)


@pytest.mark.parametrize("grouped", [False, True])
def test_litgpt(grouped):
    litgpt = pytest.importorskip("litgpt.model")
    from litgpt.config import Config

    extra = dict(n_layer=3, n_expert_groups=4, n_topk_groups=2, n_topk_scores_per_group=2, n_shared_expert=1,
                 routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1) if grouped else {}
    torch.manual_seed(0)
    model = litgpt.GPT(Config(**{**LITGPT, **extra}))
    layers = find_routed_layers(model)
    spread(layers)
    ids = torch.randint(0, 64, (3, 16))
    assert counted_against_routing(model, layers, lambda: model(ids).sum().backward()) == 2 * 48 * len(layers)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
def test_torchtitan(name):
    pytest.importorskip("torchtitan")
    from atlas_tracking.testing.torchtitan_cpu import MODELS, cpu_histc_for_expert_counts

    with cpu_histc_for_expert_counts():
        model = MODELS[name]()
        layers = find_routed_layers(model)
        ids = torch.randint(0, 64, (2, 16))
        assert counted_against_routing(model, layers, lambda: model(ids).sum().backward()) == 2 * 32 * len(layers)


def test_autoep():
    pytest.importorskip("deepspeed.module_inject.auto_ep")
    from atlas_tracking.testing.parallel_models import autoep

    model = autoep()
    layers = find_routed_layers(model)
    ids = torch.randint(0, 64, (2, 16))
    assert counted_against_routing(model, layers, lambda: model(input_ids=ids).logits.sum().backward()) == 128


def test_megatron_core_routing_map():
    pytest.importorskip("megatron.core")
    from atlas_tracking.testing.megatron_cpu import megatron_on_one_cpu_rank
    from atlas_tracking.testing.parallel_models import megatron_stack

    with contextlib.ExitStack() as stack:
        env = stack.enter_context(pytest.MonkeyPatch.context())
        from atlas_tracking.testing.distributed import one_rank_env

        one_rank_env(env)
        stack.enter_context(megatron_on_one_cpu_rank())
        model = megatron_stack()
        layers = find_routed_layers(model)
        assert [layer.index for layer in layers] == [0, 1]  # the layers' own layer_number - 1
        ids = torch.randint(0, 64, (2, 16))
        assert counted_against_routing(model, layers, lambda: model(ids).sum().backward()) == 2 * 32 * 2
