"""Every supported transformers MoE family against the model's own code, in one parametrised test.

Per family, on a tiny random model: the adapter's active sets are the ones the model hands its experts in
the same forward; ``sum_e w_e u_e(g) + shared(g)`` is the block's output within 1e-5 relative; the fp32
selection scores reproduce the model's choice when it runs in bf16; ``measure`` and ``verify`` pass (the
adapter self-check included), every receipt stated with a range stays inside it (``check_ranges``: C2, the
overlaps and redundancy distances, boundary mass, set margins; per layer, window and CI) and a checkpoint compared
with itself drifts by exactly 0.
"""

from __future__ import annotations

import re

import pytest
import torch

from atlas_tracking.adapters import NoRoutedLayersError, find_routed_layers
from atlas_tracking.testing.families import (
    FAMILIES,
    capture_layers,
    check_bf16,
    check_exact,
    check_measure,
    family_model,
)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_read_exactly(family):
    model = family_model(family)
    check_exact(family, model)
    check_measure(model)
    check_bf16(family, model)


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
    with pytest.raises(NoRoutedLayersError) as caught:
        find_routed_layers(model)
    message = str(caught.value)
    assert message.startswith("no routed MoE layer found in LlamaForCausalLM: to read your own MoE block, register")
    assert len(message.splitlines()) == 1 and len(message) < 400  # the advice first, then a few names and a count
    assert re.search(r"searched for \d+ known block classes \(Llama4TextMoe, [A-Za-z0-9]+, [A-Za-z0-9]+, \.\.\.\)$",
                     message), message


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

    from transformers.models.auto.configuration_auto import model_type_to_module_name

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
        folder = model_type_to_module_name(name)
        module = importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")
        for block in blocks:
            assert hasattr(module, block), f"{name}: transformers no longer defines {block}"
        assert reason is None or len(reason) > 40
