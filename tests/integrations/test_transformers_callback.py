"""AtlasTrainerCallback in real transformers Trainer and TRL SFTTrainer fits: the local record, W&B (offline,
read back with wandb's records) and MLflow (sqlite), resume from a Trainer checkpoint, gradient accumulation,
evaluation details, bad input."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from atlas_tracking.integrations.transformers import TRAINER_STEP_KEY, AtlasTrainerCallback, surrogate_loss
from atlas_tracking.integrations.wandb_workspace import build_workspace, logged_keys, workspace_sections
from mlflow.tracking import MlflowClient
from transformers import Trainer

from atlas_tracking import Canary, CanaryError, ConfigError, NoRoutedLayersError
from atlas_tracking.schema.verdict import gate_verdict
from atlas_tracking.testing.trainer import (
    POST_TRAINING,
    finish_trackers,
    model_from_checkpoint,
    records,
    tiny_canary,
    tiny_model,
    tiny_sets,
    trainer_args,
    use_trackers,
    wandb_runs,
)

warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*")

RULE = "canary NLL measured"
ALERTING = {**POST_TRAINING, "alerts": {"rules": [{"name": RULE, "metric": "canary_nll", "op": ">", "value": 0.0,
                                           "level": "INFO"}]}}
"""A threshold rule that fires at every gate: every gate carries an alert to deliver."""


def _evals(trainer, key: str = "eval_loss") -> dict[int, float]:
    return {int(h["step"]): h[key] for h in trainer.state.log_history if key in h}


def check_delivery(tmp_path, out, trainer, experiment: str = "atlas-trainer") -> list[dict]:
    """One gate per evaluation (and the step-0 baseline) in the record, the same gates in the W&B run
    at the Trainer's global steps with the alerts, and in the MLflow run with tags and gate artifacts."""
    recs = records(out)
    evals = _evals(trainer)
    steps = [r["step"] for r in recs]
    assert steps == [0, *sorted(evals)] and recs[0]["status"] == "BASELINE"
    assert [r["loss"] for r in recs[1:]] == [evals[s] for s in steps[1:]]
    assert all(any(a["title"] == f"atlas: {RULE}" for a in r["alerts"]) for r in recs)

    (run,) = wandb_runs(tmp_path)
    atlas_rows = [row for row in run["history"] if "atlas/c2" in row]
    assert [row[TRAINER_STEP_KEY] for row in atlas_rows] == steps
    assert [row["atlas/c2"] for row in atlas_rows] == [r["c2"] for r in recs]
    assert [row["atlas/loss"] for row in atlas_rows[1:]] == [evals[s] for s in steps[1:]]
    eval_rows = {row[TRAINER_STEP_KEY]: row["eval/loss"] for row in run["history"] if "eval/loss" in row}
    assert eval_rows == evals  # the Trainer's own W&B integration wrote to the same run, at the same steps
    assert [a["title"] for a in run["alerts"]].count(f"atlas: {RULE}") == len(recs)
    assert run["summary"]["atlas/verdict"] == gate_verdict(recs[-1]).level
    # the saved workspace's panels read keys this run holds, against the Trainer's x-axis
    keys = set().union(*(row.keys() for row in run["history"]))
    groups = tuple(recs[-1]["param_drift"]["groups"])  # the module groups this model's parameter drift names
    supervised = [s for s in workspace_sections(len(recs[0]["layers"]), groups)
                  if not s.name.startswith("atlas: rollout")]  # a reinforcement-learning loop's section
    assert logged_keys(supervised) | {TRAINER_STEP_KEY} <= keys

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (ml,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    history = client.get_metric_history(ml.info.run_id, "atlas/c2")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["c2"]) for r in recs]
    assert {m.step for m in client.get_metric_history(ml.info.run_id, "eval_loss")} == set(evals)
    assert ml.data.tags["atlas.verdict"] == gate_verdict(recs[-1]).level and ml.data.tags["atlas.stage"] == recs[-1]["stage"]
    assert ml.data.tags["atlas.alert.title"] == f"atlas: {RULE}"
    for rec in recs:
        path = client.download_artifacts(ml.info.run_id, f"atlas/gates/step_{rec['step']:08d}.json", str(tmp_path))
        saved = json.loads(Path(path).read_text())
        assert (saved["step"], saved["c2"], saved["run_id"], saved["status"]) == (
            rec["step"], rec["c2"], rec["run_id"], rec["status"])
    alerts = client.download_artifacts(ml.info.run_id, "atlas/alerts.jsonl", str(tmp_path))
    assert sum(json.loads(line)["title"] == f"atlas: {RULE}" for line in Path(alerts).read_text().splitlines()) == len(recs)
    return recs


def test_trainer_fit_with_gradient_accumulation_records_and_delivers_every_evaluation(tmp_path, monkeypatch):
    """Two micro-batches of 4 per optimizer step: gates at the Trainer's global (optimizer) steps 0, 4, 8."""
    use_trackers(monkeypatch, tmp_path)
    out = tmp_path / "out"
    train, val = tiny_sets(8)
    trainer = Trainer(tiny_model(), args=trainer_args(out, 8, eval_steps=4, report_to=["wandb", "mlflow"],
                                                      per_device_train_batch_size=4, gradient_accumulation_steps=2),
                      train_dataset=train, eval_dataset=val)
    trainer.add_callback(AtlasTrainerCallback(canary=tiny_canary(), config=ALERTING))
    try:
        trainer.train()
    finally:
        finish_trackers()
    recs = check_delivery(tmp_path, out, trainer)
    assert [r["step"] for r in recs] == [0, 4, 8] and trainer.state.global_step == 8
    assert (out / "atlas" / "baseline" / "manifest.json").exists()
    assert all(r["baseline_step"] == 0 and r["status"] != "BASELINE" for r in recs[1:])
    workspace = json.dumps(build_workspace("e", "p", 2, x_axis=TRAINER_STEP_KEY)._to_model().model_dump(mode="json"))
    assert TRAINER_STEP_KEY in workspace and "trainer/global_step" not in workspace


def test_sft_trainer_fit_records_and_delivers_every_evaluation(tmp_path, monkeypatch, script):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
    trl_sft = script("examples/trl_sft.py")
    byte_chat_tokenizer, chat_examples = trl_sft.byte_chat_tokenizer, trl_sft.chat_examples

    use_trackers(monkeypatch, tmp_path)
    out = tmp_path / "out"
    tok = byte_chat_tokenizer()
    model = tiny_model()
    model.resize_token_embeddings(len(tok))
    args = SFTConfig(output_dir=str(out), max_steps=8, eval_strategy="steps", eval_steps=4, save_strategy="no",
                     per_device_train_batch_size=4, per_device_eval_batch_size=8, learning_rate=3e-3, max_length=64,
                     report_to=["wandb", "mlflow"], use_cpu=True, logging_steps=4, disable_tqdm=True, seed=0,
                     dataloader_num_workers=0)
    trainer = SFTTrainer(model=model, args=args, processing_class=tok,
                         train_dataset=Dataset.from_list(chat_examples(0.0, 0.8)[:32]),
                         eval_dataset=Dataset.from_list(chat_examples(0.8, 0.9)[:8]),
                         callbacks=[AtlasTrainerCallback(canary=tiny_canary(), config=ALERTING)])
    try:
        trainer.train()
    finally:
        finish_trackers()
    assert [r["step"] for r in check_delivery(tmp_path, out, trainer)] == [0, 4, 8]


def test_byte_chat_tokenizer_keeps_the_demo_byte_ids(script):
    from atlas_tracking.testing.demo_data import encode
    byte_chat_tokenizer = script("examples/trl_sft.py").byte_chat_tokenizer

    tok = byte_chat_tokenizer()
    text = "Gates, wörld!\n  x"
    assert tok(text)["input_ids"] == encode(text).tolist() and tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert (len(tok), tok.eos_token_id, tok.pad_token_id) == (259, 257, 258)


def _fit(out, steps, callback, resume=None, **kw):
    """A fit with checkpoints every 5 steps; a resume reads the model from its checkpoint (``model_from_checkpoint``)."""
    train, val = tiny_sets(40)
    model = model_from_checkpoint(resume) if resume else tiny_model()
    trainer = Trainer(model, args=trainer_args(out, steps, eval_steps=5, save_steps=5, **kw),
                      train_dataset=train, eval_dataset=val, callbacks=[callback])
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return trainer


def test_resume_continues_one_history_with_the_default_and_with_restored_callback_states(tmp_path, monkeypatch):
    """Fit to step 10; resume from checkpoint-10 to step 20 with the Trainer's default (the callback passed in
    reads its state from the checkpoint's trainer_state.json) and new tracker runs; then resume from the older
    checkpoint-5 with ``restore_callback_states_from_checkpoint=True`` (the Trainer re-creates the callback)."""
    out = tmp_path / "out"
    _fit(out, 10, AtlasTrainerCallback(canary=tiny_canary(), config=POST_TRAINING))
    before = records(out)
    assert [r["step"] for r in before] == [0, 5, 10]

    use_trackers(monkeypatch, tmp_path)
    mine = AtlasTrainerCallback(canary=tiny_canary(), config=POST_TRAINING)
    try:
        trainer = _fit(out, 20, mine, resume=out / "checkpoint-10", report_to=["wandb", "mlflow"])
    finally:
        finish_trackers()
    recs = records(out)
    assert [r["step"] for r in recs] == [0, 5, 10, 15, 20]
    assert recs[:3] == before  # nothing rewritten, nothing duplicated, nothing lost
    first = recs[3]
    assert first["status"] == "BASELINE" and first["stage"] == "baseline" and first["resume"] is True
    assert first["stage_before_resume"] == before[2]["stage"]
    assert [a["level"] for a in first["alerts"] if a["key"] == "resume_baseline"] == ["INFO"]
    assert first["baseline_step"] == 0 and first["baseline_path"].endswith(f"step_00000015.{first['branch']}")
    assert recs[4]["baseline_step"] == 15 and recs[4]["status"] != "BASELINE"
    assert {r["run_id"] for r in recs} == {before[0]["run_id"]} and first["branch"] != before[0]["branch"]
    assert [r["loss"] for r in recs[3:]] == [_evals(trainer)[s] for s in (15, 20)]
    assert mine.resume_counts["moved_aside"] == 0 and mine.resume_counts["caught_up"] == 0
    # the resumed fit's tracker runs (new runs) hold exactly the record's gates, the resume alert included
    (run,) = wandb_runs(tmp_path)
    assert [row[TRAINER_STEP_KEY] for row in run["history"] if "atlas/c2" in row] == [0, 5, 10, 15, 20]
    assert "atlas: resume baseline at step 15" in [a["title"] for a in run["alerts"]]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (ml,) = client.search_runs([client.get_experiment_by_name("atlas-trainer").experiment_id])
    assert [m.step for m in client.get_metric_history(ml.info.run_id, "atlas/c2")] == [0, 5, 10, 15, 20]
    alerts = client.download_artifacts(ml.info.run_id, "atlas/alerts.jsonl", str(tmp_path))
    assert "atlas: resume baseline at step 15" in [json.loads(line)["title"] for line in Path(alerts).read_text().splitlines()]

    saved = json.loads((out / "checkpoint-5" / "trainer_state.json").read_text())["stateful_callbacks"]
    saved = saved["AtlasTrainerCallback"]
    assert saved["args"]["canary"].endswith(".npz") and saved["args"]["out_dir"] is None
    assert Canary.load(saved["args"]["canary"]) == tiny_canary()
    assert saved["attributes"]["atlas_state"]["gate"]["lineage"][-1][0] == 5
    passed = AtlasTrainerCallback(canary=tiny_canary(), config=POST_TRAINING)
    trainer = _fit(out, 10, passed, resume=out / "checkpoint-5", restore_callback_states_from_checkpoint=True)
    (recreated,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, AtlasTrainerCallback)]
    assert recreated is not passed and recreated.resume_counts["moved_aside"] == 3
    after = records(out)
    assert [r["step"] for r in after] == [0, 5, 10] and after[:2] == before[:2]
    assert after[2]["status"] == "BASELINE" and after[2]["branch"] not in {before[2]["branch"], first["branch"]}
    assert any(a["key"] == "resume_baseline" and a["level"] == "INFO" for a in after[2]["alerts"])
    assert sorted(r["step"] for r in records(out, "gates.abandoned.jsonl")) == [10, 15, 20]


def test_one_gate_per_evaluation_step_with_eval_on_start_and_two_eval_datasets(tmp_path):
    """The Trainer evaluates each dataset of a dict in turn at one step: the cadence counts steps, and the gate
    runs after the dataset its loss names (here the second one)."""
    out = tmp_path / "out"
    train, val = tiny_sets(8)
    _, other = tiny_sets(8, seed=5)
    cfg = {**POST_TRAINING, "gate": {"every_n_validations": 2}}
    trainer = Trainer(tiny_model(), args=trainer_args(out, 8, eval_steps=2, eval_on_start=True),
                      train_dataset=train, eval_dataset={"prose": val, "other": other},
                      callbacks=[AtlasTrainerCallback(canary=tiny_canary(), config=cfg, loss_key="eval_other_loss")])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no missing-loss warning
        trainer.train()
    recs = records(out)
    assert [r["step"] for r in recs] == [0, 4, 8]  # the baseline, then every second evaluation step
    assert [r["loss"] for r in recs[1:]] == [_evals(trainer, "eval_other_loss")[s] for s in (4, 8)]
    # outside training: one evaluation gate per trainer.evaluate(), read against the run's baseline
    metrics = trainer.evaluate()
    (evaluation,) = records(out, "evaluations.jsonl")
    assert evaluation["kind"] == "evaluate" and evaluation["step"] == 8 and evaluation["baseline_step"] == 0
    assert evaluation["loss"] == metrics["eval_other_loss"] and records(out) == recs  # the history did not move


def test_without_eval_strategy_one_warning_and_training_goes_on(tmp_path):
    out = tmp_path / "out"
    train, _ = tiny_sets(4)
    trainer = Trainer(tiny_model(), args=trainer_args(out, 4, eval_strategy="no"), train_dataset=train,
                      callbacks=[AtlasTrainerCallback(canary=tiny_canary(), config=POST_TRAINING)])
    with pytest.warns(UserWarning, match="eval_strategy is 'no': the Trainer never evaluates") as caught:
        trainer.train()
    assert sum("atlas" in str(w.message) for w in caught) == 1
    assert trainer.state.global_step == 4 and [r["step"] for r in records(out)] == [0]


def test_missing_eval_loss_is_a_warning_naming_the_metrics(tmp_path):
    out = tmp_path / "out"
    train, val = tiny_sets(4)
    unlabeled = [{"input_ids": val[i]["input_ids"]} for i in range(len(val))]
    trainer = Trainer(tiny_model(), args=trainer_args(out, 4, eval_steps=2), train_dataset=train,
                      eval_dataset=unlabeled, callbacks=[AtlasTrainerCallback(canary=tiny_canary(), config=POST_TRAINING)])
    with pytest.warns(UserWarning, match=r"no evaluation loss for the gate: any of eval_loss is not among the logged "
                                         r"metrics \[epoch, eval_runtime, .*AtlasTrainerCallback\(loss_key=\.\.\.\)"):
        trainer.train()
    recs = records(out)
    assert [r["step"] for r in recs] == [0, 2, 4] and all(r["loss"] is None for r in recs)


def test_a_named_metric_the_evaluation_did_not_log_fails_the_gate_and_training_goes_on(tmp_path):
    out = tmp_path / "out"
    train, val = tiny_sets(4)
    cfg = {**POST_TRAINING, "objective": {"metric": "eval_reward"}}
    trainer = Trainer(tiny_model(), args=trainer_args(out, 4, eval_steps=2), train_dataset=train, eval_dataset=val,
                      callbacks=[AtlasTrainerCallback(canary=tiny_canary(), config=cfg)])
    with pytest.warns(UserWarning, match=r"atlas gate at step 2 failed and was skipped: MissingObjectiveError: the "
                                         r"objective 'eval_reward' is not among the metrics the evaluation logged "
                                         r"\[epoch, eval_loss, eval_runtime, "):
        trainer.train()
    assert trainer.state.global_step == 4 and [r["step"] for r in records(out)] == [0]
    errors = records(out, "errors.jsonl")
    assert [e["step"] for e in errors] == [2, 4] and [e["alerts"][0]["level"] for e in errors] == ["ERROR"] * 2
    with pytest.raises(ConfigError, match=r"loss_key 'eval_loss' and 'objective.metric' 'eval_reward' name different"):
        AtlasTrainerCallback(canary=tiny_canary(), config=cfg, loss_key="eval_loss")


def test_trls_surrogate_loss_trainers_read_the_mean_reward():
    from trl import GRPOConfig, RLOOConfig, SFTConfig
    from trl.experimental.gmpo import GMPOConfig

    args = {"output_dir": "unused", "use_cpu": True, "bf16": False}
    assert [surrogate_loss(cls(**args)) for cls in (GRPOConfig, RLOOConfig, GMPOConfig, SFTConfig)] == [
        True, True, True, False]
    assert surrogate_loss(trainer_args(Path("unused"), 1)) is False


def test_failing_gate_never_stops_training(tmp_path):
    class Broken(AtlasTrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            super().on_train_begin(*args, **kwargs)

            def broken(model, ids):
                raise RuntimeError("forward failed")

            self.gate.forward = broken

    out = tmp_path / "out"
    train, val = tiny_sets(4)
    cfg = {**POST_TRAINING, "gate": {"baseline_at_start": False}}
    trainer = Trainer(tiny_model(), args=trainer_args(out, 4, eval_steps=2), train_dataset=train, eval_dataset=val,
                      callbacks=[Broken(canary=tiny_canary(), config=cfg)])
    with pytest.warns(UserWarning, match="atlas gate at step 2 failed and was skipped: RuntimeError: forward failed"):
        trainer.train()
    assert trainer.state.global_step == 4 and records(out) == []
    assert [r["step"] for r in records(out, "errors.jsonl")] == [2, 4]


def test_model_without_routed_layers_is_one_clear_error_before_training(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    train, val = tiny_sets(4)
    trainer = Trainer(dense, args=trainer_args(tmp_path, 4), train_dataset=train, eval_dataset=val,
                      callbacks=[AtlasTrainerCallback(canary=tiny_canary(), config=POST_TRAINING)])
    with pytest.raises(NoRoutedLayersError, match="no routed MoE layer found in Qwen3ForCausalLM"):
        trainer.train()
    assert trainer.state.global_step == 0 and not (tmp_path / "atlas").exists()


def test_canary_longer_than_the_context_is_one_clear_error_before_training(tmp_path):
    model = tiny_model()
    model.config.max_position_embeddings = 16
    train, val = tiny_sets(4)
    trainer = Trainer(model, args=trainer_args(tmp_path, 4), train_dataset=train, eval_dataset=val,
                      callbacks=[AtlasTrainerCallback(canary=tiny_canary(), config=POST_TRAINING)])
    with pytest.raises(CanaryError, match=r"canary window length 32 exceeds the model's context "
                                          r"\(config.max_position_embeddings=16\)"):
        trainer.train()
    assert trainer.state.global_step == 0 and not (tmp_path / "atlas").exists()


def test_callback_state_is_json_and_carries_no_secret(tmp_path):
    cfg = {**POST_TRAINING, "alerts": {"webhook_url": "http://127.0.0.1:9/secret-abc"}}
    cb = AtlasTrainerCallback(canary=tiny_canary(), config=cfg)
    train, val = tiny_sets(4)
    with pytest.warns(UserWarning, match="webhook did not receive alert"):  # nothing listens on port 9
        Trainer(tiny_model(), args=trainer_args(tmp_path, 4, eval_steps=4, save_steps=4), train_dataset=train,
                eval_dataset=val, callbacks=[cb]).train()
    text = (tmp_path / "checkpoint-4" / "trainer_state.json").read_text()
    assert "secret-abc" not in text
    saved = json.loads(text)["stateful_callbacks"]["AtlasTrainerCallback"]
    assert saved["attributes"]["atlas_state"]["webhook_url_given"] is True
    rebuilt = AtlasTrainerCallback(**saved["args"])
    assert rebuilt.config.receipts.anchors == 64 and rebuilt.config.alerts.webhook_url == ""
    assert rebuilt.canary == tiny_canary()
    assert torch.equal(torch.as_tensor(rebuilt.canary.windows), torch.as_tensor(tiny_canary().windows))


def test_every_gate_prints_one_line_on_the_terminal(tmp_path, capsys):
    out = tmp_path / "out"
    train, val = tiny_sets(4)
    trainer = Trainer(tiny_model(), args=trainer_args(out, 4, eval_steps=2), train_dataset=train, eval_dataset=val,
                      callbacks=[AtlasTrainerCallback(canary=tiny_canary(), config=POST_TRAINING)])
    trainer.train()
    printed = capsys.readouterr()
    lines = [line for line in (printed.out + printed.err).splitlines()
             if line.startswith("atlas gate step=") and " status=" in line]  # (a parameter-drift line may follow)
    recs = records(out)
    assert len(recs) >= 2
    assert [line.split()[2] for line in lines] == [f"step={r['step']}" for r in recs]  # once each, in order
    assert all(f"status={r['status']} stage={r['stage']}" in line for line, r in zip(lines, recs))
