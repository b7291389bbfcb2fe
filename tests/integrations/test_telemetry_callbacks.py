"""Training-batch routing between gates in real fits: Lightning (gradient accumulation, activation checkpointing,
a resume), the transformers Trainer and a plain loop. Every ``load.jsonl`` interval is held to the test's own counts
(:class:`~atlas_tracking.testing.collapse.OwnCounts`: its own hooks, plain loops over the router's top-k index), and
under TRL's GRPOTrainer only the updates' forwards are counted, not its no-gradient log-probability passes; a
collapse planted mid-run (one DeepSeek-V3 layer's selection bias set so that it routes to two experts) raises the
alarm within ``telemetry.consecutive`` intervals and an early gate runs before the next scheduled validation."""

from __future__ import annotations

import json
import warnings

import lightning.pytorch as pl
import pytest
import torch
from atlas_tracking.integrations.lightning import AtlasCallback
from lightning.pytorch.callbacks import ModelCheckpoint

from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.artifacts.load_record import read_load
from atlas_tracking.decisions.replay import replay
from atlas_tracking.gate import AtlasGate
from atlas_tracking.testing.collapse import OwnCounts, plant_collapse
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.lightning_lm import MoELM
from atlas_tracking.testing.tiny import POST_TRAINING, QUIET, tiny_canary, tiny_data, tiny_module

warnings.filterwarnings("ignore", ".*does not have many workers.*")

PLANT_AT = 12
"""The optimizer step after which the collapse is planted (its routes are in step 13 on)."""
EVERY = 2
PLANTED = {**POST_TRAINING, "telemetry": {"every_n_steps": EVERY, "consecutive": 2}}


def _trainer(root, steps, callbacks, **kw):
    return pl.Trainer(max_steps=steps, check_val_every_n_epoch=None, logger=False, default_root_dir=str(root),
                      callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, accelerator="cpu", devices=1, **kw)


def _gates(root):
    return [json.loads(x) for x in (root / "atlas" / "gates.jsonl").read_text().splitlines()]


class StepCounts(pl.Callback):
    """The test's own counts, closed at each optimizer step; with ``plant``, the collapse planted after it."""

    def __init__(self, own: OwnCounts, plant: int | None = None):
        self.own, self.plant, self.seen = own, plant, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.seen:
            self.seen = trainer.global_step
            self.own.end_step(self.seen)
            if self.seen == self.plant:
                plant_collapse(find_routed_layers(pl_module.model)[0])


def check_intervals(lines, own, calls_per_step):
    """Every interval equals the test's own counts of its steps; the intervals tile the steps."""
    assert [x["first_step"] for x in lines[1:]] == [x["step"] + 1 for x in lines[:-1]]
    for line in lines:
        load, tokens = own.between(line["first_step"], line["step"])
        steps = line["step"] - line["first_step"] + 1
        for row in line["layers"]:
            assert row["load"] == load[row["layer"]], (line["step"], row["layer"])
            assert (row["tokens"], row["calls"], row["processes"]) == (tokens[row["layer"]], calls_per_step * steps, 1)
        assert line["tokens"] == max(tokens.values())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lightning_counts_every_micro_batch_once_with_accumulation_and_checkpointing(tmp_path, checkpointing):
    torch.manual_seed(0)
    module = tiny_module()
    if checkpointing:  # the backward recomputes every decoder layer's forward: never a second count
        module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    own = OwnCounts(find_routed_layers(module.model))
    cb = AtlasCallback(canary=tiny_canary(), config={**QUIET, "telemetry": {"every_n_steps": 3}})
    train, val = tiny_data(24)
    _trainer(tmp_path, 12, [cb, StepCounts(own)], accumulate_grad_batches=2, val_check_interval=12,
             enable_checkpointing=False).fit(module, train, val)
    lines = read_load(tmp_path / "atlas")
    assert [(x["first_step"], x["step"]) for x in lines] == [(1, 3), (4, 6), (7, 9), (10, 12)]
    check_intervals(lines, own, calls_per_step=2)
    assert all(sum(row["load"]) == 2 * row["tokens"] and row["dropped"] is None for x in lines for row in x["layers"])
    gates = _gates(tmp_path)
    assert [(g["step"], g["trigger"], g["loss_key"]) for g in gates] == [
        (0, "start", None), (6, "validation", "val_loss"), (12, "validation", "val_loss")]
    (tmp_path / "totals.json").write_text(json.dumps([x["layers"] for x in lines]))


def test_checkpointing_changes_no_count(tmp_path):
    """The same fit with and without activation checkpointing routes the same tokens: the same counts up to the
    last bits of the recomputed arithmetic (a near-tie may flip), and exactly the same totals. (No load-balancing
    loss: under reentrant checkpointing transformers' collected router logits carry no gradient, so that loss would
    train the two fits' routers differently.)"""
    counts = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        module = tiny_module(aux_coef=0.0)
        if checkpointing:
            module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        cb = AtlasCallback(canary=tiny_canary(), config={**QUIET, "gate": {"baseline_at_start": False},
                                                          "telemetry": {"every_n_steps": 4}})
        train, val = tiny_data(16)
        root = tmp_path / str(checkpointing)
        _trainer(root, 8, [cb], accumulate_grad_batches=2, val_check_interval=100, enable_checkpointing=False
                 ).fit(module, train, val)
        counts[checkpointing] = [[row["load"] for row in x["layers"]] for x in read_load(root / "atlas")]
    for plain, checkpointed in zip(counts[False], counts[True]):
        for a, b in zip(plain, checkpointed):
            assert sum(a) == sum(b)
            assert sum(abs(x - y) for x, y in zip(a, b)) <= 0.01 * sum(a)


def _planted_model():
    return family_model("deepseek_v3", vocab_size=256).train()


def check_alarm(lines, layer_name):
    """No breach before the collapse, breach from its first interval, the alarm at its second (``consecutive``)."""
    before = [x for x in lines if x["step"] <= PLANT_AT]
    assert before and all(x["breach"] == [] and x["alerts"] == [] for x in before)
    first, second = (next(x for x in lines if x["first_step"] > PLANT_AT + k * EVERY) for k in (0, 1))
    assert [b["name"] for b in first["breach"]] == [layer_name] and first["alerts"] == [] and not first["early_gate"]
    (alarm,) = second["alerts"]
    assert alarm["level"] == "WARN" and alarm["key"] == "telemetry:alarm" and second["early_gate"]
    assert layer_name in alarm["text"] and "had routes in the reference interval and none now" in alarm["text"]
    assert "experts 2, 3, 4 (+3 more)" in alarm["text"]
    return second["step"]


def check_early_gate(gates, alarm_step, next_validation, root):
    early = [g for g in gates if g["trigger"] == "telemetry"]
    assert [g["step"] for g in early] == [alarm_step] and alarm_step < next_validation
    assert early[0]["loss"] is None and early[0]["loss_key"] is None
    assert f"alarm at step {alarm_step}" in json.dumps(early[0]["trigger_reason"]) or early[0]["trigger_reason"]
    assert any(g["step"] == next_validation and g["trigger"] == "validation" for g in gates)
    # the stage comes from the gates alone: replaying the record gives every stage it holds
    assert [r["stage"] for r in replay(gates)] == [g["stage"] for g in gates]
    alerts = [json.loads(x) for x in (root / "alerts.jsonl").read_text().splitlines()]
    assert any(a["key"] == "telemetry:alarm" and a["step"] == alarm_step for a in alerts)


def test_lightning_planted_collapse_raises_the_alarm_and_an_early_gate(tmp_path):
    torch.manual_seed(0)
    module = MoELM(_planted_model(), lr=1e-4)
    own = OwnCounts(find_routed_layers(module.model))
    cb = AtlasCallback(canary=tiny_canary(), config=PLANTED)
    train, val = tiny_data(20)
    _trainer(tmp_path, 20, [cb, StepCounts(own, plant=PLANT_AT)], val_check_interval=10,
             enable_checkpointing=False).fit(module, train, val)
    lines = read_load(tmp_path / "atlas")
    check_intervals(lines, own, calls_per_step=1)
    alarm_step = check_alarm(lines, cb.gate.layers[0].name)
    assert alarm_step == PLANT_AT + 2 * EVERY
    check_early_gate(_gates(tmp_path), alarm_step, 20, tmp_path / "atlas")


def test_plain_loop_runs_the_early_gate_at_the_step_that_raised_the_alarm(tmp_path):
    torch.manual_seed(0)
    model = _planted_model()
    gate = AtlasGate(model, tiny_canary(), PLANTED, out_dir=tmp_path / "atlas")
    gate.run(0, trigger="start")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train, _ = tiny_data(20)
    early = {}
    for step, batch in enumerate(train, start=1):
        model.train()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == PLANT_AT:
            plant_collapse(gate.layers[0])
        record = gate.step(step)
        if record is not None:
            early[step] = record
    gate.finish()
    alarm_step = check_alarm(read_load(tmp_path / "atlas"), gate.layers[0].name)
    assert list(early) == [alarm_step] and early[alarm_step]["trigger"] == "telemetry"
    assert gate.telemetry.requested is None  # answered


def test_trainer_planted_collapse_with_accumulation(tmp_path):
    from atlas_tracking.integrations.transformers import AtlasTrainerCallback
    from transformers import Trainer, TrainerCallback

    from atlas_tracking.testing.trainer import tiny_sets, trainer_args

    torch.manual_seed(0)
    model = _planted_model()
    own = OwnCounts(find_routed_layers(model))

    class Plant(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            own.end_step(state.global_step)
            if state.global_step == PLANT_AT:
                plant_collapse(find_routed_layers(model)[0])

    train, val = tiny_sets(40, batch=4)
    args = trainer_args(tmp_path, 20, eval_steps=10, gradient_accumulation_steps=2, per_device_train_batch_size=4,
                        logging_steps=EVERY, learning_rate=1e-4)
    callback = AtlasTrainerCallback(canary=tiny_canary(), config={**POST_TRAINING, "telemetry": {"consecutive": 2}})
    Trainer(model, args=args, train_dataset=train, eval_dataset=val, callbacks=[Plant(), callback]).train()
    lines = read_load(tmp_path / "atlas")
    assert all(x["step"] % EVERY == 0 for x in lines)  # the Trainer's logging_steps set the cadence
    check_intervals(lines, own, calls_per_step=2)
    alarm_step = check_alarm(lines, find_routed_layers(model)[0].name)
    check_early_gate(_gates(tmp_path), alarm_step, 20, tmp_path / "atlas")


def test_a_resume_keeps_one_history_of_intervals(tmp_path):
    """Intervals every 4 steps, gates every 6, checkpoints every 5: the run is resumed from its step-10 checkpoint
    after reaching 15. The intervals the first segment wrote after step 10 move to ``load.abandoned.jsonl``; the
    first interval after the resume starts at step 11 and names the steps 9-10 whose routes no line holds."""
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    cfg = {**QUIET, "telemetry": {"every_n_steps": 4}}
    train, val = tiny_data(40)
    torch.manual_seed(0)
    _trainer(tmp_path, 15, [AtlasCallback(canary=tiny_canary(), config=cfg), ckpt], val_check_interval=6
             ).fit(tiny_module(), train, val)
    first = read_load(tmp_path / "atlas")
    assert [(x["first_step"], x["step"]) for x in first] == [(1, 4), (5, 6), (7, 8), (9, 12), (13, 15)]
    torch.manual_seed(0)
    _trainer(tmp_path, 20, [AtlasCallback(canary=tiny_canary(), config=cfg)], val_check_interval=6
             ).fit(tiny_module(), train, val, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=10.ckpt"))
    lines = read_load(tmp_path / "atlas")
    assert [(x["first_step"], x["step"]) for x in lines] == [(1, 4), (5, 6), (7, 8), (11, 12), (13, 16), (17, 18),
                                                             (19, 20)]
    assert lines[3]["uncounted"] == [9, 10] and "uncounted" not in lines[4]
    assert {x["branch"] for x in lines[:3]} == {first[0]["branch"]} and lines[3]["branch"] != first[0]["branch"]
    parked = [json.loads(x) for x in (tmp_path / "atlas" / "load.abandoned.jsonl").read_text().splitlines()]
    assert sorted((x["step"], x["branch"]) for x in parked) == [(12, first[0]["branch"]), (15, first[0]["branch"])]
    gates = _gates(tmp_path)
    assert [g["step"] for g in gates] == [0, 6, 12, 18] and gates[2]["resume"]


def test_telemetry_off_adds_no_hook_and_no_file(tmp_path):
    module = tiny_module()
    cb = AtlasCallback(canary=tiny_canary(), config={**QUIET, "telemetry": {"enabled": False}})
    train, val = tiny_data(6)
    _trainer(tmp_path, 6, [cb], val_check_interval=6, enable_checkpointing=False).fit(module, train, val)
    assert cb.gate.telemetry is None and not (tmp_path / "atlas" / "load.jsonl").exists()
    hooks = [hook for layer in find_routed_layers(module.model) for hook in layer.router._forward_hooks.values()]
    assert not any("RouteCounter" in getattr(hook, "__qualname__", "") for hook in hooks)
    assert [g["trigger"] for g in _gates(tmp_path)] == ["start", "validation"]


def test_grpo_counts_the_update_forwards_only(tmp_path, script):
    """TRL's GRPOTrainer with two updates per generation computes the old policy's log-probabilities in a
    training-mode pass under ``torch.no_grad()``, and generates: the intervals hold the forwards inside the trainer's
    ``compute_loss`` (the test's own counts, switched on there only) and nothing else."""
    from atlas_tracking.integrations.transformers import AtlasTrainerCallback
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from atlas_tracking.testing.trainer import tiny_model

    tokenizer = script("examples/trl_sft.py").byte_chat_tokenizer()
    tokenizer.padding_side = "left"
    model = tiny_model(aux_coef=0.0)
    model.resize_token_embeddings(len(tokenizer))
    model.config.eos_token_id, model.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    layers = find_routed_layers(model)
    own = OwnCounts(layers)
    own.skipped = True  # counted inside compute_loss only

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            own.end_step(state.global_step)

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, gradient_checkpointing=False, report_to=[],
                      max_steps=4, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                      num_iterations=2, beta=0.0, logging_steps=1, save_strategy="no", seed=0,
                      dataloader_num_workers=0, disable_tqdm=True)
    callback = AtlasTrainerCallback(canary=tiny_canary(), config={**POST_TRAINING, "telemetry": {"every_n_steps": 2}})
    def reward(completion_ids, **_):
        return [0.1 * len(c) for c in completion_ids]

    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": [f"note {i}:" for i in range(32)]}),
                          callbacks=[Steps(), callback])
    compute_loss, logps = trainer.compute_loss, trainer._get_per_token_logps_and_entropies
    passes = []  # (training mode, gradients on) of each log-probability pass

    def counted_compute_loss(*a, **kw):
        own.skipped = False
        try:
            return compute_loss(*a, **kw)
        finally:
            own.skipped = True

    def seen_logps(model, *a, **kw):
        passes.append((model.training, torch.is_grad_enabled()))
        return logps(model, *a, **kw)

    trainer.compute_loss, trainer._get_per_token_logps_and_entropies = counted_compute_loss, seen_logps
    trainer.train()
    assert passes.count((True, False)) == 2 and passes.count((True, True)) == 4  # old policy's, per generation
    lines = read_load(tmp_path / "atlas")
    assert [(x["first_step"], x["step"]) for x in lines] == [(1, 2), (3, 4)]
    check_intervals(lines, own, calls_per_step=1)
