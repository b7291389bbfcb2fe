"""The gate's hot path moves the expert fields by rows: no element-wise gather over ``[tokens, k, d]``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from atlas_tracking import AtlasConfig, Canary, measure
from atlas_tracking.engine.combine import ascending_adds
from atlas_tracking.testing.families import family_model

CFG = AtlasConfig.from_dict({"receipts": {"progress": False, "n_bootstrap": 50, "batch_windows": 2}})


class FieldGathers(TorchDispatchMode):
    """Counts ``aten.gather`` calls whose output has three dimensions or more (per-token fields)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.gather and out.dim() >= 3:
            self.count += 1
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_gate_moves_fields_by_rows(dtype):
    model = family_model("qwen3_moe", seed=3).to(dtype)
    canary = Canary.from_token_ids(np.random.default_rng(0).integers(0, 64, 2000), window=20, n_windows=4, seed=0)
    with FieldGathers() as gathers:
        report = measure(model, canary, config=CFG)
    assert gathers.count == 0
    assert {layer["selfcheck"]["layer_output"] for layer in report.layers} <= {"slots", "ascending"}


def test_ascending_adds_is_the_gathered_sum_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(50, 4, 8, generator=gen, dtype=torch.bfloat16)
    w = torch.rand(50, 4, generator=gen).to(torch.bfloat16)
    index = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(50)])
    order = index.argsort(dim=1, stable=True)
    terms = (u * w.unsqueeze(-1)).gather(1, order.unsqueeze(-1).expand(-1, -1, 8)).to(torch.bfloat16)
    expected = terms.new_zeros((50, 8))
    for j in range(4):
        expected = expected + terms[:, j]
    assert torch.equal(ascending_adds(u, w, index, torch.bfloat16), expected)
