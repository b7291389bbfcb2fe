"""A layer's combine is checked against the experts' own forward once per arithmetic and process
(docs/receipts.md#precision): a later gate with the same arithmetic reuses the verdict and its forward is
still the model's own, bit for bit; a gate under another arithmetic checks again."""

from __future__ import annotations

import pytest
import torch

from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.engine.capture import LayerCapture
from atlas_tracking.engine.combine import arithmetic_key
from atlas_tracking.testing.families import check_own_forward, family_model, to_dtype


@pytest.fixture
def checked(monkeypatch) -> list[str]:
    """The layers whose combine a gate compared with the experts' own forward, in order."""
    names: list[str] = []
    original = LayerCapture._first_combine

    def counting(self, outs, own):
        names.append(self.layer.name)
        return original(self, outs, own)

    monkeypatch.setattr(LayerCapture, "_first_combine", counting)
    return names


@pytest.mark.parametrize("family", ["qwen3_moe", "longcat_flash"])  # a combine reproduces it; none does (own)
def test_a_later_gate_reuses_the_verdict_and_stays_the_models_own_forward(family, checked):
    model = family_model(family)
    fused = [lay.name for lay in find_routed_layers(model) if lay.fusable]
    check_own_forward(family, model)
    assert checked == fused  # the first gate compares every fused layer once
    check_own_forward(family, model)
    assert checked == fused  # the same arithmetic: nothing compared again, and the forward is still the model's
    check_own_forward(family, to_dtype(model, torch.bfloat16))
    assert checked == fused * 2  # another dtype is another arithmetic: compared again


def test_autocast_is_part_of_the_arithmetic(checked):
    model = family_model("qwen3_moe")
    check_own_forward("qwen3_moe", model)
    check_own_forward("qwen3_moe", model, autocast=torch.bfloat16)
    layers = len(find_routed_layers(model))
    assert len(checked) == 2 * layers
    check_own_forward("qwen3_moe", model, autocast=torch.bfloat16)
    assert len(checked) == 2 * layers


def test_the_arithmetic_key_changes_with_each_part_of_the_arithmetic():
    experts = torch.nn.Linear(4, 4)
    hidden, index, weights = torch.zeros(6, 4), torch.zeros(6, 2, dtype=torch.long), torch.ones(6, 2)
    key = arithmetic_key(experts.forward, experts, hidden, index, weights)
    assert arithmetic_key(experts.forward, experts, hidden.clone(), index, weights) == key  # the numbers: no
    others = [arithmetic_key(experts.forward, experts, hidden.bfloat16(), index, weights),
              arithmetic_key(experts.forward, experts, hidden[:3], index[:3], weights[:3]),
              arithmetic_key(lambda *a: None, experts, hidden, index, weights)]
    with torch.no_grad():
        others.append(arithmetic_key(experts.forward, experts, hidden, index, weights))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        others.append(arithmetic_key(experts.forward, experts, hidden, index, weights))
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium" if precision != "medium" else "highest")
    try:
        others.append(arithmetic_key(experts.forward, experts, hidden, index, weights))
    finally:
        torch.set_float32_matmul_precision(precision)
    assert all(other != key for other in others)
