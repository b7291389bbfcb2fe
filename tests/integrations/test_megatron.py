"""Megatron-Core: the adapter's selection equals moe_utils.topk_routing_with_score_function (CPU);
a full MoELayer forward with the adapter attached (CUDA, and on CPU with the stand-in for the router's
CUDA-only gating from atlas_tracking.testing.megatron_cpu); examples/megatron_loop.py end to end on CPU."""

from __future__ import annotations

import json
import math
import types
import zlib

import pytest
import torch
from atlas_tracking.integrations.megatron import RouterSpec, megatron_selection

from atlas_tracking.testing.distributed import one_rank_env

moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")

from atlas_tracking.testing.megatron_cpu import cpu_router_gating  # noqa: E402  (imports Megatron-Core)

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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Megatron-Core's router gating needs CUDA")
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_full_moe_layer_forward_matches_the_adapter(dtype, tolerance, record_property):
    """Megatron-Core's real layer (router gating, alltoall dispatcher) against the adapter's ``sum w u``: within
    1e-5 relative in fp32; in bf16 within 1e-2 (the layer's output is rounded to bf16, unit roundoff 2^-8)."""

    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from atlas_tracking.adapters import find_routed_layers
    from atlas_tracking.testing.megatron_te import transformer_engine_gemm_absent

    if not torch.distributed.is_initialized():
        with pytest.MonkeyPatch.context() as env:  # a free port: parallel test workers each start a group
            one_rank_env(env)
            torch.distributed.init_process_group("nccl", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2,
                            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                            moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.0,
                            moe_router_load_balancing_type="none", moe_token_dispatcher_type="alltoall",
                            add_bias_linear=False, normalization="RMSNorm", bf16=dtype == torch.bfloat16,
                            params_dtype=dtype)
    layer = build_module(get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False), config=cfg,
                         layer_number=1).cuda().eval()
    with torch.no_grad():
        layer.mlp.router.weight.normal_(0, 0.5)
        layer.mlp.router.expert_bias.normal_(0, 0.1)
    (adapter,) = find_routed_layers(torch.nn.ModuleDict({"layer": layer}))
    seen = {}
    # copies: the layer adds the residual to the MoE output in place after the block returns
    hs = [adapter.norm.register_forward_hook(lambda m, i, o: seen.update(g=o.clone())),
          adapter.router.register_forward_hook(lambda m, i, o: seen.update(r=o)),
          adapter.block.register_forward_hook(lambda m, i, o: seen.update(out=o[0].clone()))]
    x = torch.randn(16, 2, 64, device="cuda", dtype=dtype)
    with torch.no_grad(), transformer_engine_gemm_absent():
        layer(x, attention_mask=None)
    for h in hs:
        h.remove()
    g = seen["g"].reshape(-1, 64)
    routing = adapter.routing(seen["r"], g)
    with torch.no_grad():
        combined = (routing.weights.unsqueeze(-1) * adapter.expert_outputs(g, routing.active).float()).sum(1)
    out = seen["out"].reshape(-1, 64).float()
    rel = float((combined - out).norm() / out.norm())
    record_property("recombination_relative_error", rel)
    assert rel < tolerance


@pytest.fixture(scope="module")
def megatron_cpu():
    """Megatron-Core process groups on one gloo rank, and ``atlas_tracking.testing.megatron_cpu``'s CPU stand-in
    for ``TopKRouter.gating`` (the real one moves the router weights to CUDA first)."""
    from megatron.core import parallel_state

    with pytest.MonkeyPatch.context() as env:  # restored after: later tests and their subprocesses inherit it
        if not torch.distributed.is_initialized():
            one_rank_env(env)
            torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        with cpu_router_gating():
            yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def _cpu_gmm_stand_in(a, b, batch_sizes, trans_b=False):
    """CPU stand-in for the CUDA-only ``grouped_gemm.ops.gmm`` kernel: rows ``a`` come grouped by
    expert (``batch_sizes[e]`` rows for expert ``e``) and group ``e`` is multiplied by ``b[e]``."""
    groups = a.split(batch_sizes.tolist())
    return torch.cat([x @ (w.t() if trans_b else w) for x, w in zip(groups, b)])


@pytest.fixture
def grouped_gemm_on_cpu(monkeypatch):
    """Megatron's legacy ``GroupedMLP`` on CPU: its availability check passes and ``gg.ops.gmm`` is the
    CPU stand-in above. Its activation is run eagerly (Megatron's ``noop_decorator``, what
    ``disable_jit_fuser`` selects) rather than through ``torch.compile``, which on CPU only adds a long
    compile of the same function."""
    from megatron.core.jit import noop_decorator
    from megatron.core.transformer.moe import experts
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    monkeypatch.setattr(gg, "assert_grouped_gemm_is_available", lambda: None)
    monkeypatch.setattr(gg, "ops", types.SimpleNamespace(gmm=_cpu_gmm_stand_in))
    monkeypatch.setattr(experts, "jit_fuser", noop_decorator)


class MegatronMoEStack(torch.nn.Module):
    """Embedding, two Megatron ``TransformerLayer``s used for their pre-MLP norm and ``MoELayer`` only
    (their attention needs CUDA), sequence-first hidden states, and an LM head. ``normalization`` is Megatron's
    config value ("RMSNorm" or "LayerNorm", then a ``torch.nn.LayerNorm`` with a bias). ``experts`` picks the
    local spec's ``SequentialMLP`` or (``moe_grouped_gemm``) legacy ``GroupedMLP``, whose forward asserts
    ``config.bf16`` (the parameters stay fp32 here); ``gated`` uses SwiGLU experts instead of GeLU."""

    def __init__(self, vocab=64, d=32, experts="sequential", gated=False, normalization="RMSNorm"):
        super().__init__()
        import torch.nn.functional as F
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.spec_utils import build_module
        from megatron.core.transformer.transformer_config import TransformerConfig

        grouped = experts == "grouped"
        cfg = TransformerConfig(num_layers=2, hidden_size=d, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2,
                                moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather",
                                add_bias_linear=False, normalization=normalization, params_dtype=torch.float32,
                                use_cpu_initialization=True, moe_router_num_groups=4, moe_router_group_topk=2,
                                moe_grouped_gemm=grouped, bf16=grouped, gated_linear_unit=gated,
                                activation_func=F.silu if gated else F.gelu)
        torch.manual_seed(0)
        spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=grouped)
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList([build_module(spec, config=cfg, layer_number=i + 1) for i in range(2)])
        self.head = torch.nn.Linear(d, vocab)
        with torch.no_grad():
            for layer in self.layers:
                layer.mlp.router.weight.normal_(0, 1.0)

    def forward(self, input_ids):
        x = self.embed(input_ids).transpose(0, 1)  # [seq, batch, d]
        for layer in self.layers:
            out, bias = layer.mlp(layer.pre_mlp_layernorm(x))
            x = x + out + (bias if bias is not None else 0)
        return self.head(x.transpose(0, 1))


EXPERT_KINDS = {"sequential": ("sequential", False), "sequential_swiglu": ("sequential", True),
                "grouped": ("grouped", False), "grouped_swiglu": ("grouped", True)}


@pytest.mark.parametrize("kind", list(EXPERT_KINDS))
def test_moe_layer_on_cpu_recombines_and_measures(megatron_cpu, grouped_gemm_on_cpu, kind):
    import json

    import numpy as np

    from atlas_tracking import AtlasConfig, Baseline, Canary, measure
    from atlas_tracking.adapters import find_routed_layers
    from atlas_tracking.artifacts.gate_report import verify

    experts, gated = EXPERT_KINDS[kind]
    model = MegatronMoEStack(experts=experts, gated=gated).eval()
    assert type(model.layers[0].mlp.experts).__name__ == {"sequential": "SequentialMLP", "grouped": "GroupedMLP"}[experts]
    layers = find_routed_layers(model)
    assert [(lay.family, lay.sequence_first) for lay in layers] == [("megatron", True)] * 2
    seen = {}
    lay = layers[0]
    hs = [lay.norm.register_forward_hook(lambda m, i, o: seen.update(g=o)),
          lay.router.register_forward_hook(lambda m, i, o: seen.update(r=o)),
          lay.block.register_forward_hook(lambda m, i, o: seen.update(out=o))]
    with torch.no_grad():
        model(torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(2)))
    for h in hs:
        h.remove()
    g = seen["g"].reshape(-1, 32)
    routing = lay.routing(seen["r"], g)  # raises if it differs from the router's routing_map
    with torch.no_grad():
        combined = (routing.weights.unsqueeze(-1) * lay.expert_outputs(g, routing.active)).sum(1)
    out = lay.block_output(seen["out"]).reshape(-1, 32)
    assert (combined - out).norm() / out.norm() < 1e-5
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "n_bootstrap": 100, "anchors": 32}})
    canary = Canary.from_token_ids(np.random.default_rng(0).integers(0, 64, 3000), window=12, n_windows=4, seed=0)
    report = measure(model, canary, config=cfg)
    assert verify(json.loads(report.to_json())) == []
    assert all(layer["receipts"]["rank_violations"] == 0 for layer in report.layers)
    again = measure(model, canary, baseline=Baseline.from_report(report), config=cfg)
    assert all(layer[k] == 0.0 for layer in again.drift["layers"]
               for k in ("coord_drift", "boundary_drift", "transition_drift", "content_drift"))


def test_input_jitter_is_switched_off_during_a_gate(megatron_cpu):
    import numpy as np

    from atlas_tracking import AtlasConfig, Canary, measure

    model = MegatronMoEStack().eval()
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "n_bootstrap": 50, "anchors": 16}})
    canary = Canary.from_token_ids(np.random.default_rng(0).integers(0, 64, 3000), window=12, n_windows=4, seed=0)
    plain = measure(model, canary, config=cfg)
    model.layers[0].mlp.router.config.moe_input_jitter_eps = 0.1  # one config for both layers
    jittered = measure(model, canary, config=cfg)
    assert [lay["receipts"] for lay in jittered.layers] == [lay["receipts"] for lay in plain.layers]
    router = model.layers[0].mlp.router
    assert "apply_input_jitter" not in vars(router)  # the model's own jitter again after the gate
    x = torch.ones(4, 32)
    assert not torch.equal(router.apply_input_jitter(x), x)


def test_layernorm_pre_norm_is_read_on_the_layernorm_state(megatron_cpu):
    import numpy as np

    from atlas_tracking import AtlasConfig, Baseline, Canary, measure
    from atlas_tracking.adapters import find_routed_layers
    from atlas_tracking.artifacts.gate_report import verify

    model = MegatronMoEStack(normalization="LayerNorm").eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.pre_mlp_layernorm.weight.normal_(1.0, 0.1)
            layer.pre_mlp_layernorm.bias.normal_(0.0, 0.1)
    assert [lay.norm_type for lay in find_routed_layers(model)] == ["layernorm"] * 2
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "n_bootstrap": 100, "anchors": 32}})
    canary = Canary.from_token_ids(np.random.default_rng(0).integers(0, 64, 3000), window=12, n_windows=4, seed=0)
    report = measure(model, canary, config=cfg)
    assert verify(report.to_dict()) == []
    assert all(layer["selfcheck"]["gain"] < 1e-6 for layer in report.layers)
    again = measure(model, canary, baseline=Baseline.from_report(report), config=cfg)
    assert all(layer[k] == 0.0 for layer in again.drift["layers"]
               for k in ("coord_drift", "boundary_drift", "transition_drift", "content_drift"))


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
def test_grouped_mlp_fields_equal_sequential_mlp_with_the_same_weights(megatron_cpu, grouped_gemm_on_cpu, gated):
    """GroupedMLP's ``weight1``/``weight2`` copied expert by expert into a SequentialMLP's fc1/fc2 (as
    GroupedMLP.forward views them): the adapter reads the same expert functions from both."""
    from atlas_tracking.adapters import find_routed_layers

    grouped = MegatronMoEStack(experts="grouped", gated=gated).eval()
    sequential = MegatronMoEStack(experts="sequential", gated=gated).eval()
    for gl, sl in zip(grouped.layers, sequential.layers):
        ge, se = gl.mlp.experts, sl.mlp.experts
        w1 = ge.weight1.view(ge.num_local_experts, 32, -1)
        w2 = ge.weight2.view(ge.num_local_experts, -1, 32)
        with torch.no_grad():
            for e, expert in enumerate(se.local_experts):
                expert.linear_fc1.weight.copy_(w1[e].t())
                expert.linear_fc2.weight.copy_(w2[e].t())
    g = torch.randn(40, 32, generator=torch.Generator().manual_seed(3))
    every = torch.arange(8).expand(40, 8)
    for gl, sl in zip(find_routed_layers(grouped), find_routed_layers(sequential)):
        with torch.no_grad():
            ours, theirs = gl.expert_outputs(g, every), sl.expert_outputs(g, every)
        assert ours.shape == (40, 8, 32) and theirs.abs().min() > 0
        assert (ours - theirs).abs().max() < 1e-6


def test_megatron_loop_example_runs_on_cpu(tmp_path, monkeypatch, capsys, script):
    """examples/megatron_loop.py's main() on the CPU path (CUDA hidden if present): a GPTModel trains
    and every gate writes one record to gates.jsonl."""
    megatron_loop = script("examples/megatron_loop.py")
    from megatron.core.transformer.moe.router import TopKRouter

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gating = TopKRouter.gating
    out = tmp_path / "atlas"
    assert megatron_loop.main(["--steps", "4", "--every", "2", "--out", str(out)]) == 0
    assert TopKRouter.gating is gating  # the stand-in is removed again
    records = [json.loads(line) for line in (out / "gates.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 2, 4]
    assert records[0]["status"] == "BASELINE" and records[0]["loss"] is None
    assert all(math.isfinite(r["c2"]) for r in records)
    assert all(math.isfinite(r["loss"]) for r in records[1:])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert [int(line.split()[1]) for line in printed] == [0, 2, 4]
