"""Every supported transformers MoE family against the model's own code, in one parametrised test.

Per family, on a tiny random model: the adapter's active sets are the ones the model hands its experts in
the same forward; ``sum_e w_e u_e(g) + shared(g)`` is the block's output within 1e-5 relative; the fp32
selection scores reproduce the model's choice when it runs in bf16; ``measure`` and ``verify`` pass (the
adapter self-check included) and a checkpoint compared with itself drifts by exactly 0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from families import FAMILIES, capture_layers, family_model, to_dtype

from atlas_tracking import AtlasConfig, Baseline, Canary, measure
from atlas_tracking.adapters import NoRoutedLayersError, find_routed_layers
from atlas_tracking.gate_report import verify

CFG = AtlasConfig.from_dict({"receipts": {"progress": False, "batch_windows": 4, "anchors": 24, "n_bootstrap": 20}})
DRIFT = ("coord_drift", "boundary_drift", "transition_drift", "content_drift")


def _recombined(lay, g, routing):
    with torch.no_grad():
        u = lay.expert_outputs(g, routing.active)
        combined = (routing.weights.unsqueeze(-1) * u.float()).sum(1)
        shared = lay.shared_output(g)
    return combined if shared is None else combined + shared.float().reshape(combined.shape)


def _check_exact(family, model):
    ids = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(1))
    layers, seen = capture_layers(model, ids)
    assert layers, family
    for lay in layers:
        d = seen[lay.name]
        g = d["g"].reshape(-1, d["g"].shape[-1])
        routing = lay.routing(d["router"], g)
        if "index" in d:  # the sets the model handed its experts in this forward
            theirs = d["index"].reshape(len(g), -1)
            assert [set(r) for r in routing.active.tolist()] == [set(r) for r in theirs.tolist()], lay.name
        kth = routing.scores.gather(1, routing.active).min(1).values
        outside = routing.scores.scatter(1, routing.active, float("-inf")).max(1).values
        assert bool((kth >= outside).all()), lay.name  # the model's choice is a top-k of the adapter's scores
        out = d["out"].reshape(len(g), -1).float()
        rel = (_recombined(lay, g, routing) - out).norm() / out.norm()
        assert rel < 1e-5, (family, lay.name, float(rel))
        assert torch.allclose(routing.rho.sum(1), torch.ones(len(g)), atol=1e-5)
        assert torch.allclose(routing.probs.sum(1), torch.ones(len(g)), atol=1e-5)
        assert routing.scores.shape[1] == lay.num_experts and routing.active.shape[1] == lay.top_k


def _check_bf16(family, model):
    ids = torch.randint(0, 64, (4, 24), generator=torch.Generator().manual_seed(2))
    layers, seen = capture_layers(to_dtype(model, torch.bfloat16), ids)
    for lay in layers:
        d = seen[lay.name]
        routing = lay.routing(d["router"], d["g"].reshape(-1, d["g"].shape[-1]))
        ours = routing.scores.topk(lay.top_k, dim=1).indices
        theirs = d["index"].reshape(len(ours), -1).long() if "index" in d else routing.active
        kth = routing.scores.gather(1, theirs).min(1).values
        outside = routing.scores.scatter(1, theirs, float("-inf")).max(1).values
        ties = kth == outside  # exact ties in the model's own scores: either choice is the model's
        same = torch.tensor([set(a) == set(b) for a, b in zip(ours.tolist(), theirs.tolist())])
        assert bool((same | ties).all()), (family, lay.name)
        assert bool((kth >= outside).all()), (family, lay.name)


def _check_measure(model):
    canary = Canary.from_token_ids(np.arange(400) * 7 % 64, window=16, n_windows=4, seed=0)
    report = measure(model, canary, config=CFG)
    assert verify(report.to_dict()) == []
    assert all(lay["selfcheck"]["recombination"] is not None for lay in report.layers)
    again = measure(model, canary, baseline=Baseline.from_report(report), config=CFG)
    assert verify(again.to_dict()) == []
    for lay in again.drift["layers"]:
        assert [lay[k] for k in DRIFT] == [0.0] * 4, lay["name"]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_read_exactly(family):
    model = family_model(family)
    _check_exact(family, model)
    _check_measure(model)
    _check_bf16(family, model)


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


def test_deepseek_v4_hash_routed_layers_are_left_out():
    layers = find_routed_layers(family_model("deepseek_v4"))
    assert [lay.name for lay in layers] == ["model.layers.1.mlp"]  # layer 0 routes by a token-id table


def test_model_without_routed_layers_names_the_searched_classes():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(NoRoutedLayersError, match=r"no routed MoE layer found in LlamaForCausalLM.*Qwen3MoeSparseMoeBlock"):
        find_routed_layers(model)


def _moe_model_types() -> dict[str, str]:
    """Causal-LM model types of the installed transformers whose modeling code mentions experts -> module."""
    import importlib.util
    from pathlib import Path

    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = {}
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        module = model_type_to_module_name(model_type)
        spec = importlib.util.find_spec(f"transformers.models.{module}")
        folder = Path(spec.origin).parent if spec and spec.origin else None
        if folder and any("experts" in f.read_text() for f in folder.glob("modeling_*.py")):
            found[model_type] = module
    return found


def test_every_causal_lm_moe_family_of_the_installed_transformers_is_supported_or_refused():
    """Walks the installed transformers' causal-LM registry: a MoE model type that is neither read (a row of the
    family table, with a tiny test config) nor refused with a reason nor known not to be MoE fails this test, and
    so does a row whose block class the installed transformers no longer defines."""
    import importlib

    from atlas_tracking.adapters.families import FAMILIES as ROWS
    from atlas_tracking.adapters.families import NOT_MOE, REFUSED, REFUSED_ALIASES

    moe = _moe_model_types()
    supported = {row.name: row for row in ROWS} | {alias: row for row in ROWS for alias in row.model_types}
    refused = set(REFUSED) | set(REFUSED_ALIASES)
    unknown = sorted(set(moe) - set(supported) - refused - set(NOT_MOE))
    assert not unknown, f"causal-LM MoE families neither supported nor refused with a reason: {unknown}"
    assert len(set(moe) - set(NOT_MOE)) >= 57
    assert set(REFUSED_ALIASES.values()) <= set(REFUSED)
    untested = sorted(row.name for row in ROWS if row.name not in FAMILIES)
    assert not untested, f"supported families without a tiny test config: {untested}"
    for name, (blocks, reason) in [*((r.name, (r.blocks, None)) for r in ROWS), *REFUSED.items()]:
        module = importlib.import_module(f"transformers.models.{moe[name]}.modeling_{moe[name]}")
        for block in blocks:
            assert hasattr(module, block), f"{name}: transformers no longer defines {block}"
        assert reason is None or len(reason) > 40
