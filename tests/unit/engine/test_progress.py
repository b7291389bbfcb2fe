"""Progress of a gate: one rewritten line on a terminal, plain lines in a log file."""

from __future__ import annotations

import io
import sys

import numpy as np
import torch

from atlas_tracking import Canary, measure


def test_progress_in_a_log_file_is_plain_lines(tmp_path, monkeypatch):
    """stderr that is not a terminal (a log file) gets whole lines, never carriage returns."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2))
    canary = Canary.from_token_ids(np.arange(4000) % 64, window=32, n_windows=16, seed=0)
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    measure(model, canary, config={"receipts": {"progress": True, "batch_windows": 4, "n_bootstrap": 50}})
    text = log.getvalue()
    assert "\r" not in text
    assert text.endswith("\n") and "atlas: 16/16 canary windows" in text.splitlines()[-1]
