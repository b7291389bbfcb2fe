"""AtlasTrainerCallback with a PEFT LoRA model (discovery through the wrapper, the adapters' effect in the receipts)
and under accelerate's DDP on 2 gloo processes (receipts within the world-size tolerance of one process)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from atlas_tracking.integrations.transformers import AtlasTrainerCallback
from transformers import Trainer

from atlas_tracking import AtlasConfig, Baseline, measure
from atlas_tracking.testing.distributed import run_workers
from atlas_tracking.testing.tolerance import assert_within_tolerance
from atlas_tracking.testing.trainer import (
    DDP_CONFIG,
    POST_TRAINING,
    QUIET,
    ddp_fit,
    lora_model,
    records,
    tiny_canary,
    tiny_model,
    tiny_sets,
    trainer_args,
)

warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*")

PEFT_PREFIX = "base_model.model."
"""What ``get_peft_model`` puts before the wrapped model's module names."""
ROUTING = ("boundary_drift", "transition_drift")
"""Drift of the routing: zero exactly when the router and the norms' gains are frozen (docs/receipts.md#drift-between-checkpoints)."""


def _unnamed(layers: list[dict]) -> list[dict]:
    return [{k: v for k, v in layer.items() if k != "name"} for layer in layers]


def _lora_fit(tmp_path, target: str):
    """LoRA (``target``) on the tiny Qwen3-MoE, 6 steps at a learning rate that moves the adapters, gates every 3.
    Returns the PEFT model, the gate records, and the receipts of the model measured before it was wrapped."""
    config = AtlasConfig.coerce(QUIET)
    peft_model = lora_model(target)
    with peft_model.disable_adapter():  # the model as it was before get_peft_model
        pre = json.loads(measure(peft_model.get_base_model(), tiny_canary(), config=config).to_json())
    train, val = tiny_sets(6)
    out = tmp_path / "out"
    trainer = Trainer(peft_model, args=trainer_args(out, 6, eval_steps=3, learning_rate=1e-2), train_dataset=train,
                      eval_dataset=val, callbacks=[AtlasTrainerCallback(canary=tiny_canary(), config=POST_TRAINING)])
    trainer.train()
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, AtlasTrainerCallback))
    assert [layer.name for layer in callback.gate.layers] == [f"{PEFT_PREFIX}model.layers.{i}.mlp" for i in (0, 1)]
    recs = records(out)
    assert [r["step"] for r in recs] == [0, 3, 6] and recs[0]["status"] == "BASELINE"
    # the step-0 baseline (LoRA B = 0) is the pre-LoRA model's, bit for bit (same process, layout and kernels);
    # only the layers' names carry PEFT's prefix
    step0 = json.loads((out / "atlas" / "receipts" / "step_00000000.json").read_text())
    assert _unnamed(step0["layers"]) == _unnamed(pre["layers"]) and step0["summary"] == pre["summary"]
    return peft_model, recs, out


def test_lora_on_the_experts_moves_c2_and_content_drift_with_routing_drift_zero(tmp_path):
    peft_model, recs, out = _lora_fit(tmp_path, "experts")
    assert type(peft_model.base_model.model.model.layers[0].mlp.experts).__name__ == "ParamWrapper"
    for rec in recs[1:]:
        assert abs(rec["c2_delta"]) > 0.05  # the adapted experts' fields change the co-active overlaps
        for layer in rec["layers"]:
            assert layer["content_drift"] > 0.05 and all(layer[k] == 0.0 for k in ROUTING)
    # independent check: the adapters merged into a plain model give the gate's receipts (another kernel order:
    # W + BA merged against W with BA applied in the forward, so within the world-size tolerances)
    baseline = Baseline.load(out / "atlas" / "baseline")
    merged = peft_model.merge_and_unload()
    again = json.loads(measure(merged, tiny_canary(), baseline=baseline, base=baseline,  # the run's base is its baseline
                               config=AtlasConfig.coerce(QUIET)).to_json())
    gate = (out / "atlas" / "receipts" / "step_00000006.json").read_text().replace(PEFT_PREFIX, "")
    assert_within_tolerance(json.loads(gate), again)


def test_lora_on_attention_only_leaves_boundary_and_content_drift_exactly_zero(tmp_path):
    peft_model, recs, _ = _lora_fit(tmp_path, "attention")
    assert not any(p.requires_grad for n, p in peft_model.named_parameters() if ".mlp." in n or "norm" in n)
    for rec in recs[1:]:
        assert rec["c2_delta"] != 0.0  # the adapted attention moves the states the experts see
        for layer in rec["layers"]:
            assert layer["boundary_drift"] == 0.0 and layer["content_drift"] == 0.0 and layer["transition_drift"] == 0.0
        assert rec["layers"][1]["coord_drift"] > 0.01  # the second layer's inputs moved
    # against a baseline measured on the model before it was wrapped (layer names without PEFT's prefix)
    config = AtlasConfig.coerce(QUIET)
    with peft_model.disable_adapter():
        pre = Baseline.from_report(measure(peft_model.get_base_model(), tiny_canary(), config=config))
    drift = measure(peft_model, tiny_canary(), baseline=pre, config=config).drift
    assert [d["name"] for d in drift["layers"]] == [f"{PEFT_PREFIX}model.layers.{i}.mlp" for i in (0, 1)]
    assert all(d["boundary_drift"] == 0.0 and d["content_drift"] == 0.0 for d in drift["layers"])
    assert drift["layers"][1]["coord_drift"] > 0.01


@pytest.mark.slow
def test_ddp_on_two_processes_gates_within_the_world_size_tolerance_of_one_process(tmp_path):
    out = tmp_path / "two"
    workers = run_workers(ddp_fit, 2, str(out), 6, 3, timeout=400)
    assert [w["world"] for w in workers] == [2, 2]
    assert workers[0]["last"] == workers[1]["last"]  # every rank returns the same gate
    recs = records(out)
    assert [r["step"] for r in recs] == [0, 3, 6]  # rank zero writes each gate once
    # one process measuring the same weights: the initial model (the baseline) and the trained one (the last gate)
    from safetensors.torch import load_model

    config = AtlasConfig.coerce(DDP_CONFIG)
    first = measure(tiny_model(aux_coef=0.0), tiny_canary(), config=config, step=0)
    trained = tiny_model(aux_coef=0.0)
    load_model(trained, str(out / "weights.safetensors"))
    base = Baseline.from_report(first)
    last = measure(trained, tiny_canary(), baseline=base, base=base, config=config)  # the run's base is its baseline
    receipts = out / "atlas" / "receipts"
    assert_within_tolerance(json.loads(first.to_json()), json.loads((receipts / "step_00000000.json").read_text()))
    assert_within_tolerance(json.loads(last.to_json()), json.loads((receipts / "step_00000006.json").read_text()))
    assert last.drift is not None and torch.isfinite(torch.tensor(last.drift["handoff_margin"]))
