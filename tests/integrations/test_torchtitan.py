"""torchtitan's MoE (torchtitan 0.2, its for-loop experts path on CPU): the same exactness checks as every
transformers family, on its own DeepSeek-V3, Qwen3 and Llama 4 models; the gate leaves the load-balancing
statistic as it found it; the plain-loop example end to end."""

from __future__ import annotations

import pytest
import torch

from atlas_tracking.adapters import NoRoutedLayersError, find_routed_layers
from atlas_tracking.testing.families import check_bf16, check_exact, check_measure, spread

pytest.importorskip("torchtitan.models.moe")
from atlas_tracking.testing.torchtitan_cpu import MODELS, cpu_histc_for_expert_counts


def forward(model, ids):
    return model(ids)


@pytest.fixture(autouse=True)
def _cpu_histc():
    with cpu_histc_for_expert_counts():
        yield


def titan_model(name: str):
    model = MODELS[name]().eval()
    spread(find_routed_layers(model))
    return model


@pytest.mark.parametrize("name", list(MODELS))
def test_torchtitan_moe_is_read_exactly(name):
    model = titan_model(name)
    layers = find_routed_layers(model)
    assert {lay.family for lay in layers} == {"torchtitan"}
    before = [lay.block.tokens_per_expert.clone() for lay in layers]
    check_measure(model, forward)
    assert all(torch.equal(b, lay.block.tokens_per_expert) for b, lay in zip(before, layers))  # no trace of the gates
    check_exact(f"torchtitan-{name}", model, forward)
    check_bf16(f"torchtitan-{name}", model, forward)


def test_expert_bias_moves_the_choice_and_groups_mask():
    model = titan_model("deepseek_v3")
    lay = find_routed_layers(model)[0]
    assert [x.name for x in find_routed_layers(model)] == ["layers.1.moe", "layers.2.moe"]  # layer 0 is dense
    g = torch.randn(30, 32)
    with torch.no_grad():
        lay.block.expert_bias.zero_()
        lay.block.expert_bias[5] = 10.0
        routing = lay.route(g)
    assert bool((routing.active == 5).any(1).all())
    assert bool((torch.isinf(routing.scores).sum(1) == 4).all())  # 2 of 4 groups of 2 eligible


def test_input_scaled_with_normalised_weights_is_refused():
    model = MODELS["llama4"]()
    for module in model.modules():
        if type(module).__name__ == "TokenChoiceTopKRouter":
            module.route_norm = True
    with pytest.raises(NoRoutedLayersError, match="score_before_experts with route_norm"):
        find_routed_layers(model)


@pytest.mark.slow
def test_plain_loop_example(tmp_path, script):
    import json

    main = script("examples/torchtitan_loop.py").main

    from atlas_tracking.artifacts.gate_report import read_artifact, verify

    gates = main(["--out", str(tmp_path), "--steps", "20", "--every", "10"])
    records = [json.loads(line) for line in gates.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 10, 20] and records[0]["status"] == "BASELINE"
    data = read_artifact(sorted((tmp_path / "receipts").glob("*.json"))[-1])
    assert data["model"]["families"] == ["torchtitan"] and verify(data) == []
