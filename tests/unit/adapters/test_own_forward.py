"""A gate's forward is the model's own, in the model's precision (docs/receipts.md#precision).

For every family the adapters read, in float32, bfloat16 and float16 checkpoints and under bf16 autocast: the
hooks of the test see, in every routed layer and every call of a gate's forward, the block output of the plain
forward bit for bit and the same indices handed to the experts, and the gate's per-window loads count the
model's own choice.
"""

from __future__ import annotations

import pytest
import torch

from atlas_tracking.testing.families import FAMILIES, check_own_forward, family_model

FP16_BROKEN = {"deepseek_v4": "its float16 forward fails in transformers itself (a float32 matmul operand)"}
"""Families whose own forward cannot run in a dtype: nothing for a gate to be compared with."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_gate_forward_is_the_models_own(family, dtype):
    if dtype == torch.float16 and family in FP16_BROKEN:
        pytest.skip(FP16_BROKEN[family])
    check_own_forward(family, family_model(family, dtype=dtype))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "longcat_flash", "llama4_text"])
def test_gate_forward_is_the_models_own_under_autocast(family):
    check_own_forward(family, family_model(family), autocast=torch.bfloat16)


def test_unfused_gate_forward_is_the_models_own():
    check_own_forward("qwen3_moe", family_model("qwen3_moe", dtype=torch.bfloat16), fuse=False)
