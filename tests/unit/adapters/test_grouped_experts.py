"""transformers' grouped_mm experts read as their own code computes them (``adapters/grouped_experts.py``).

The reference is transformers itself: the experts' own forward at the same inputs. The weighted sum of the fields
:func:`grouped_fields` returns must be that forward's output bit for bit (the capture hands it back as the layer's
output only where it is; docs/receipts.md#precision), and each further pair's field must be what the experts' forward
gives for those pairs asked one a row with unit weights, whether the products run as grouped products or expert by expert.
"""

from __future__ import annotations

import pytest
import torch

from atlas_tracking import AtlasConfig, Canary, measure
from atlas_tracking.adapters import grouped_experts
from atlas_tracking.adapters.base import find_routed_layers
from atlas_tracking.adapters.grouped_experts import grouped_fields, grouped_implementation
from atlas_tracking.adapters.hf import HFLayer
from atlas_tracking.testing.families import ORIGINAL, family_model
from atlas_tracking.testing.host_reads import host_reads

FAMILIES = (*ORIGINAL, "aria_text")
"""The first families read, and one whose experts hold transposed weights without a bias (GPT-OSS's have both)."""


def _inputs(layer, dtype: torch.dtype, n: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    e, k, d = layer.experts.num_experts, layer.top_k, layer.hidden_size
    x = torch.randn(n, d, generator=g).to(dtype)
    index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g).to(dtype)
    pairs = [(x, torch.randint(0, e, (n, 1), generator=g)), (x[:5], index[:5])]  # a competitor each, and a sample
    return x, index, weights, pairs


@pytest.mark.parametrize("expert_by_expert", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_fields_sum_to_the_experts_own_output(family, dtype, expert_by_expert, monkeypatch):
    monkeypatch.setattr(grouped_experts, "INTERLEAVE_BYTES", 0 if expert_by_expert else 1 << 62)
    layer = find_routed_layers(family_model(family, dtype=dtype))[0]
    experts = layer.experts
    assert grouped_implementation(experts) is not None
    with torch.no_grad():  # a fresh model's expert biases are zero: give them values to add
        for name, param in experts.named_parameters():
            if name.endswith("_bias"):
                param.copy_(torch.randn(param.shape) * 0.5)
    x, index, weights, pairs = _inputs(layer, dtype)
    with torch.no_grad(), host_reads() as reads:
        fields, further = grouped_fields(experts, x, index, pairs)
    assert reads.total == 0, reads.where  # the expert-by-expert path runs on the CPU only: its sizes are host memory
    with torch.no_grad():
        own = experts(x, index, weights)
        assert fields.shape == (*index.shape, x.shape[-1]) and fields.dtype == own.dtype
        assert torch.equal((fields * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype), own)
        rows = torch.cat([r.repeat_interleave(e.shape[1], dim=0) for r, e in pairs])  # the pairs one a row
        chosen = torch.cat([e.reshape(-1, 1) for _, e in pairs])
        alone = experts(rows, chosen, torch.ones(len(chosen), 1, dtype=dtype))  # as the capture's pair call asks
        assert [got.shape for got in further] == [(*e.shape, x.shape[-1]) for _, e in pairs]
        assert torch.equal(torch.cat([got.reshape(-1, x.shape[-1]) for got in further]), alone)

def test_only_transformers_grouped_mm_experts_are_read_so():
    layer = find_routed_layers(family_model("qwen3_moe"))[0]
    experts = layer.experts
    assert grouped_implementation(experts) is not None
    for implementation in ("eager", "batched_mm"):
        experts.config._experts_implementation = implementation
        assert grouped_implementation(experts) is None
        assert layer.grouped_outputs(*_inputs(layer, torch.float32)[:2], []) is None  # the capture's pair calls
    experts.config._experts_implementation = "grouped_mm"
    experts._is_expert_parallel = True
    assert grouped_implementation(experts) is None
    assert grouped_implementation(torch.nn.Linear(2, 2)) is None
    with pytest.raises(ValueError, match="grouped_mm experts implementation"):
        grouped_fields(torch.nn.Linear(2, 2), torch.ones(1, 2), torch.zeros(1, 1, dtype=torch.long))


def test_a_gate_reads_the_same_receipts_either_way(monkeypatch):
    """The capture's receipts from the grouped reading equal those of the experts asked one pair a row."""
    model = family_model("qwen3_moe")
    canary = Canary.from_token_ids(torch.arange(900).mul(7).remainder(64).numpy(), window=32, n_windows=6, seed=0)
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "batch_windows": 2, "n_bootstrap": 50}})
    calls = []
    real = HFLayer.grouped_outputs

    def counted(self, *args):
        calls.append(self.name)
        return real(self, *args)

    monkeypatch.setattr(HFLayer, "grouped_outputs", counted)
    grouped = measure(model, canary, config=cfg, keep_anchors=False)
    assert len(calls) == len(grouped.layers) * 3  # every micro-batch of every layer
    monkeypatch.setattr(HFLayer, "grouped_outputs", lambda self, *args: None)
    paired = measure(model, canary, config=cfg, keep_anchors=False)
    for a, b in zip(grouped.layers, paired.layers):
        assert a["selfcheck"]["layer_output"] == b["selfcheck"]["layer_output"] == "slots"
        for key, value in a["receipts"].items():
            if isinstance(value, float):
                assert value == pytest.approx(b["receipts"][key], rel=1e-6, abs=1e-7, nan_ok=True), key
