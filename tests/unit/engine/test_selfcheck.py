"""The adapter self-check fires on each wrong entry the family survey found, fused and unfused, and names it.

Each wrong entry is a row of the family table with one thing wrong, read on the family's real model: these
entries pass ``measure`` and ``verify`` without the self-check (verify recomputes from a self-consistent
artifact), which is why every gate runs it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from atlas_tracking import AtlasConfig, Canary, measure
from atlas_tracking.adapters import NoRoutedLayersError, find_routed_layers
from atlas_tracking.adapters.base import _layer_index
from atlas_tracking.adapters.families import FAMILIES, SOFTMAX, Family
from atlas_tracking.adapters.hf import factory
from atlas_tracking.engine.selfcheck import AdapterCheckError
from atlas_tracking.testing.families import family_model

CANARY = Canary.from_token_ids(np.arange(600) * 5 % 64, window=16, n_windows=4, seed=0)
ROWS = {row.name: row for row in FAMILIES}
WRONG = {
    "(1 + w) gain read as w": ("qwen3_next", replace(ROWS["qwen3_next"], gain="w"), "gain"),
    "shared expert left out": ("qwen2_moe", replace(ROWS["qwen2_moe"], shared=None), "recombination"),
    "LayerNorm read as RMSNorm": ("phimoe", replace(ROWS["phimoe"], norm_type="rms"), "gain"),
    "post-norm read as pre-norm": ("flex_olmo", Family("flex_olmo", ("FlexOlmoSparseMoeBlock",), SOFTMAX), "block_input"),
}


def flex_olmo_model():
    from transformers import FlexOlmoConfig, FlexOlmoForCausalLM

    torch.manual_seed(0)
    return FlexOlmoForCausalLM(FlexOlmoConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                              num_experts_per_tok=2, pad_token_id=0)).eval()


def layers_read_with(model, row: Family):
    """The model's MoE blocks read through ``row`` (as if it were registered for them)."""
    modules = dict(model.named_modules())
    layers = [factory(row)(name, _layer_index(name), m, modules[name.rsplit(".", 1)[0]])
              for name, m in modules.items() if type(m).__name__ in row.blocks]
    for i, lay in enumerate(layers):
        lay.ordinal = i
    return layers


def config(fuse: bool) -> AtlasConfig:
    return AtlasConfig.from_dict({"receipts": {"progress": False, "batch_windows": 4, "anchors": 16, "n_bootstrap": 20,
                                               "fuse_experts": fuse}})


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("wrong", list(WRONG))
def test_the_self_check_fires_on_a_wrong_entry(wrong, fuse):
    family, row, check = WRONG[wrong]
    model = flex_olmo_model() if family == "flex_olmo" else family_model(family)
    layers = layers_read_with(model, row)
    assert layers
    with pytest.raises(AdapterCheckError, match=rf"{layers[0].name} \({family}\).*\[{check}: "):
        measure(model, CANARY, config=config(fuse), layers=layers)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen2_moe"])
def test_the_right_entry_passes_with_its_errors_recorded(family):
    model = family_model(family)
    report = measure(model, CANARY, config=config(True))
    for lay in report.layers:
        s = lay["selfcheck"]
        assert s["tolerance"] == pytest.approx(1e-3)
        assert all(s[k] <= 1e-5 for k in ("gain", "block_input", "recombination", "experts_call"))
        assert s["active_set"] == 0.0 and s["rank_violation_share"] == 0.0


def test_wrong_selection_scores_fire_the_active_set_check():
    model = family_model("deepseek_v3")
    row = replace(ROWS["deepseek_v3"], router=replace(ROWS["deepseek_v3"].router, bias=None))  # bias forgotten
    with torch.no_grad():
        for lay in find_routed_layers(model):
            lay.router.e_score_correction_bias.normal_(0, 1.0)  # a bias that moves the choice
    with pytest.raises(AdapterCheckError, match=r"model\.layers\.1\.mlp \(deepseek_v3\).*not a top-k"):
        measure(model, CANARY, config=config(True), layers=layers_read_with(model, row))


def test_a_refused_family_names_its_reason():
    with pytest.raises(NoRoutedLayersError, match=r"flex_olmo MoE block model\.layers\.0\.mlp .*post-norm block"):
        find_routed_layers(flex_olmo_model())


def test_a_forward_under_autocast_is_checked_at_its_working_precision():
    """fp32 weights under bf16 autocast (a Trainer with ``bf16=True``): the block's products are bf16 while its
    tensors stay fp32, so the tolerance is bf16's; a fp32 tolerance would fail a correct adapter."""
    model = family_model("qwen3_moe")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = measure(model, CANARY, config=config(True))
    for lay in report.layers:
        s = lay["selfcheck"]
        assert s["tolerance"] == pytest.approx(2e-2)
        assert s["recombination"] is not None and 0 <= s["recombination"] <= 2e-2 and s["active_set"] <= 0.01
