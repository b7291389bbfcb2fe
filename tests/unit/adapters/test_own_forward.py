"""A gate's forward is the model's own, in the model's precision (docs/receipts.md#precision).

For every family the adapters read, in float32, bfloat16 and float16 checkpoints and under bf16 autocast: the
hooks of the test see, in every routed layer and every call of a gate's forward, the block output of the plain
forward bit for bit and the same indices handed to the experts, and the gate's per-window loads count the
model's own choice.
"""

from __future__ import annotations

import pytest
import torch

from atlas_tracking.testing.families import FAMILIES, check_own_forward, family_model, to_dtype

FP16_BROKEN = {"deepseek_v4": "its float16 forward fails in transformers itself (a float32 matmul operand)"}
"""Families whose own forward cannot run in float16: nothing for a gate to be compared with there."""


@pytest.mark.parametrize("family", FAMILIES)
def test_gate_forward_is_the_models_own(family):
    model = family_model(family)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # the checkpoint as transformers loads it
        if dtype == torch.float16 and family in FP16_BROKEN:
            continue
        check_own_forward(family, to_dtype(model, dtype))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "longcat_flash", "llama4_text"])
def test_gate_forward_is_the_models_own_under_autocast(family):
    check_own_forward(family, family_model(family), autocast=torch.bfloat16)


def test_unfused_gate_forward_is_the_models_own():
    check_own_forward("qwen3_moe", family_model("qwen3_moe", dtype=torch.bfloat16), fuse=False)
