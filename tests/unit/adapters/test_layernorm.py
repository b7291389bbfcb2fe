"""The LayerNorm state (docs/receipts.md#layernorm-state): ``z``, ``zh`` and ``g = Gamma z + beta`` of a layer read
through a mean-centred LayerNorm against a plain numpy loop and the norm module's own output, the norm type each
kind of norm is read with, and exact zero drift wherever a LayerNorm model's routed parts are frozen.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from atlas_tracking import AtlasConfig, Baseline, Canary, measure
from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.adapters.base import norm_type_of
from atlas_tracking.artifacts.gate_report import verify
from atlas_tracking.receipts.geometry import rms_normalize
from atlas_tracking.testing.families import check_exact, check_measure, family_model

CFG = AtlasConfig.from_dict({"receipts": {"progress": False, "batch_windows": 4, "anchors": 24, "n_bootstrap": 20}})
CANARY = Canary.from_token_ids(np.arange(600) * 7 % 64, window=16, n_windows=4, seed=0)
DRIFTS = ("coord_drift", "boundary_drift", "transition_drift", "content_drift")


def numpy_layernorm_state(x: np.ndarray, eps: float) -> np.ndarray:
    """``z = (x - mean(x)) / sqrt(var(x) + eps)``, token by token, in float64."""
    z = np.empty_like(x, dtype=np.float64)
    for t, row in enumerate(x.astype(np.float64)):
        mean = sum(row) / len(row)
        var = sum((v - mean) ** 2 for v in row) / len(row)
        z[t] = [(v - mean) / (var + eps) ** 0.5 for v in row]
    return z


@pytest.mark.parametrize("family", ["phimoe", "dbrx", "cohere2_moe"])
def test_state_direction_and_gain_match_a_numpy_loop_and_the_norm(family):
    layer = find_routed_layers(family_model(family))[0]
    assert layer.norm_type == "layernorm"
    x = torch.randn(12, layer.hidden_size, generator=torch.Generator().manual_seed(0)) * 3 + 1.5
    expected = numpy_layernorm_state(x.numpy(), layer.norm_eps)
    z = layer.normalize(x)
    assert z.dtype == torch.float32
    np.testing.assert_allclose(z.numpy(), expected, rtol=1e-5, atol=1e-5)
    assert float(z.sum(-1).abs().max()) < 1e-4  # orthogonal to the all-ones vector
    zh = expected / np.linalg.norm(expected, axis=-1, keepdims=True)
    np.testing.assert_allclose(layer.direction(x).numpy(), zh, rtol=1e-5, atol=1e-6)
    gamma = layer.norm.weight.detach().double().numpy()
    bias = getattr(layer.norm, "bias", None)
    beta = np.zeros_like(gamma) if bias is None else bias.detach().double().numpy()
    assert (layer.beta() is None) == (bias is None) and (family == "phimoe") == (bias is not None)
    with torch.no_grad():
        g = layer.gain(z)
        own = layer.norm(x)
    np.testing.assert_allclose(g.numpy(), gamma * expected + beta, rtol=1e-5, atol=1e-5)
    assert float((g - own).norm() / own.norm()) < 1e-6  # the module's own output


def test_norm_type_of_each_kind_of_norm():
    te_layernorm = type("LayerNorm", (nn.Module,), {})  # Transformer Engine's class, by name
    assert [norm_type_of(m) for m in (nn.LayerNorm(4), nn.LayerNorm(4, bias=False), te_layernorm(), nn.RMSNorm(4))] \
        == ["layernorm", "layernorm", "layernorm", "rms"]


def test_cohere2_moe_reads_the_norm_and_combination_its_config_picks():
    """With ``rms_norm_eps`` set, Cohere2-MoE's pre-norm is an RMSNorm; sigmoid weights and summed shared experts."""
    model = family_model("cohere2_moe", rms_norm_eps=1e-6, expert_selection_fn="sigmoid",
                         shared_expert_combination_strategy="sum")
    layers = find_routed_layers(model)
    assert {(lay.norm_type, type(lay.norm).__name__) for lay in layers} == {("rms", "Cohere2MoeRMSNorm")}
    check_exact("cohere2_moe", model)
    check_measure(model)


def test_the_rms_path_is_unchanged():
    layer = find_routed_layers(family_model("qwen3_moe"))[0]
    assert layer.norm_type == "rms" and layer.beta() is None
    x = torch.randn(10, layer.hidden_size, generator=torch.Generator().manual_seed(1))
    z = layer.normalize(x)
    assert torch.equal(z, rms_normalize(x, layer.norm_eps))
    assert torch.equal(layer.gain(z), layer.gamma() * z)
    assert torch.equal(layer.direction(x), x / x.norm(dim=-1, keepdim=True))


def test_baseline_keeps_the_layernorm_bias_where_the_norm_has_one(tmp_path):
    for family, has_bias in (("phimoe", True), ("dbrx", False)):
        model = family_model(family)
        base = Baseline.load(Baseline.from_report(measure(model, CANARY, config=CFG)).save(tmp_path / family))
        for i, layer in enumerate(find_routed_layers(model)):
            assert torch.equal(base.tensors[f"{i}.gamma0"], layer.gamma())
            assert (f"{i}.beta0" in base.tensors) == has_bias
            if has_bias:
                assert torch.equal(base.tensors[f"{i}.beta0"], layer.beta())


def test_a_layernorm_model_drifts_by_exactly_zero_wherever_it_is_frozen():
    """Against itself every drift is 0; with only attention trained (norm, router and experts frozen) the gate
    inputs move but routing and content at the transported anchors ``Gamma z0 + beta`` do not."""
    model = family_model("phimoe")
    base = Baseline.from_report(measure(model, CANARY, config=CFG))
    same = measure(model, CANARY, baseline=base, config=CFG)
    assert verify(same.to_dict()) == []
    assert [[layer[k] for k in DRIFTS] for layer in same.drift["layers"]] == [[0.0] * 4] * 2
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for block in moved.model.layers:
            block.self_attn.o_proj.weight.add_(0.2 * torch.randn_like(block.self_attn.o_proj.weight))
    report = measure(moved, CANARY, baseline=base, config=CFG)
    assert verify(report.to_dict()) == []
    assert all(layer["coord_drift"] > 0 for layer in report.drift["layers"])
    assert all(layer[k] == 0.0 for layer in report.drift["layers"] for k in DRIFTS[1:])
