"""TRL's GRPOTrainer with the Trainer callback on the CPU: the gate's objective is the mean reward, maximised, never
GRPO's surrogate ``eval_loss``; a reward that rises reads ``improving``; every rollout the policy generates is handed to
the gate (``rollout.jsonl``, ``atlas/rollout/...``). The callback's W&B offline files are read back with wandb's own
records and its MLflow run from a real ``mlflow server`` on 127.0.0.1 (sqlite)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from atlas_tracking.integrations.transformers import TRAINER_STEP_KEY, AtlasTrainerCallback

from atlas_tracking.decisions.replay import replay
from atlas_tracking.testing.tiny import POST_TRAINING, tiny_canary
from atlas_tracking.testing.trainer import finish_trackers, records, tiny_model, wandb_runs

STEPS, EVAL_STEPS = 30, 10
LETTERS = range(ord("a"), ord("z") + 1)


def letter_share(completion_ids: list[list[int]], **_: object) -> list[float]:
    """A verifiable toy reward: the share of a completion's tokens that are lowercase ASCII letters (byte ids 97-122;
    about a tenth of a random byte model's tokens)."""
    return [sum(t in LETTERS for t in ids) / max(1, len(ids)) for ids in completion_ids]


def grpo_fit(out: Path, tokenizer, report_to: list[str], callback: AtlasTrainerCallback):
    """A tiny Qwen3-MoE trained by GRPO on :func:`letter_share`, evaluated every ``EVAL_STEPS`` steps (TRL's
    defaults bf16, gradient checkpointing and a learning rate of 1e-6 are set for a short CPU fit)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    # no aux loss: once an evaluation has run, transformers' Qwen3-MoE fails in GRPO's generation with it (router
    # logits of the new tokens against the whole attention mask), with the callback or without it
    model = tiny_model(aux_coef=0.0)
    model.resize_token_embeddings(len(tokenizer))
    model.config.eos_token_id, model.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    args = GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False, gradient_checkpointing=False, report_to=report_to,
                      max_steps=STEPS, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                      per_device_eval_batch_size=8, eval_strategy="steps", eval_steps=EVAL_STEPS,
                      logging_steps=EVAL_STEPS, learning_rate=1e-2, lr_scheduler_type="constant", beta=0.0,
                      save_strategy="no", seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[letter_share], args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": [f"note {i}:" for i in range(64)]}),
                          eval_dataset=Dataset.from_dict({"prompt": [f"eval {i}:" for i in range(8)]}),
                          callbacks=[callback])
    trainer.train()
    return trainer


def _evaluations(trainer, key: str) -> dict[int, float]:
    return {int(h["step"]): h[key] for h in trainer.state.log_history if key in h}


def expected_trends(values: list[float], window: int = 2) -> list[str]:
    """The loss trend of each gate after the first, for a maximised objective, computed here in a plain loop:
    higher than the value ``window`` gates back (or the first) and not lower than the previous one."""
    return [("improving" if v > values[max(0, i - window)] and v >= values[i - 1] else "stalling")
            for i, v in enumerate(values) if i > 0]


@pytest.mark.slow
def test_grpo_fit_reads_its_rising_reward_as_improving_on_every_tracker(tmp_path, monkeypatch, script, mlflow_server):
    tokenizer = script("examples/trl_sft.py").byte_chat_tokenizer()
    tokenizer.padding_side = "left"  # GRPO pads prompts on the left for generation
    finish_trackers()
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path),
                        "WANDB_PROJECT": "atlas-grpo", "MLFLOW_TRACKING_URI": mlflow_server.uri,
                        "MLFLOW_EXPERIMENT_NAME": "atlas-grpo", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    try:
        trainer = grpo_fit(out, tokenizer, ["wandb", "mlflow"], AtlasTrainerCallback(canary=tiny_canary(),
                                                                                     config=POST_TRAINING))
    finally:
        finish_trackers()

    rewards, surrogate = _evaluations(trainer, "eval_reward"), _evaluations(trainer, "eval_loss")
    steps = sorted(rewards)
    assert steps == list(range(EVAL_STEPS, STEPS + 1, EVAL_STEPS)) and set(surrogate) == set(steps)
    values = [rewards[s] for s in steps]
    assert all(b > a for a, b in itertools.pairwise(values)), f"the fit's reward did not rise: {values}"

    recs = records(out)
    assert [r["step"] for r in recs] == [0, *steps] and recs[0]["status"] == "BASELINE"
    assert {r["objective_direction"] for r in recs} == {"maximize"}
    assert [(r["loss_key"], r["loss"]) for r in recs[1:]] == [("eval_reward", v) for v in values]
    trends = [r["loss_trend"] for r in recs[2:]]
    assert trends == expected_trends(values) and set(trends) == {"improving"}
    # the reward's rise is named in its direction: licensed, or, when the canary NLL rose since the base (the base
    # domain damaged), withheld with the number that withholds it
    last = recs[-1]
    claimed = [c for c in last["licensed"] if c == "The objective improved on the visited region (eval_reward / State3)."]
    denied = [c for c in last["unlicensed"] if c.startswith("That the objective improved: on the training data eval_reward rose")]
    assert len(claimed) + len(denied) == 1, (last["licensed"], last["unlicensed"])
    if denied:
        assert f"{last['canary_nll_delta_cumulative']:+.4f}" in denied[0] and "the loss" not in denied[0]
    # the record replays to the decisions it made live; read as a loss, the same rising numbers stall
    assert [d["loss_trend"] for d in replay(recs)] == [r["loss_trend"] for r in recs]
    as_loss = [{**r, "objective_direction": "minimize"} for r in recs]
    assert {d["loss_trend"] for d in replay(as_loss)[2:]} == {"stalling"}

    # every rollout the policy generated in training was handed to the gate: one line per optimizer step
    rollouts = records(out, "rollout.jsonl")
    assert [line["step"] for line in rollouts] == list(range(1, STEPS + 1))
    assert all(row["tokens"] > 0 and row["fallback"] == 0 for line in rollouts for row in line["layers"])
    assert all(line["layer_axis"] == "routed" and not line["replayed"] for line in rollouts)

    (run,) = wandb_runs(tmp_path)
    rollout_rows = [row for row in run["history"] if "atlas/rollout/mismatch_max" in row]
    assert [row[TRAINER_STEP_KEY] for row in rollout_rows] == list(range(1, STEPS + 1))
    assert [row["atlas/rollout/mismatch_max"] for row in rollout_rows] == [
        max(row["mismatch"] for row in line["layers"]) for line in rollouts]
    atlas_rows = [row for row in run["history"] if "atlas/c2" in row]
    assert [row[TRAINER_STEP_KEY] for row in atlas_rows] == [0, *steps]
    assert [row["atlas/loss"] for row in atlas_rows[1:]] == values
    assert {row[TRAINER_STEP_KEY]: row["eval/reward"] for row in run["history"] if "eval/reward" in row} == rewards
    assert run["summary"]["atlas/stage"] == recs[-1]["stage"]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server.uri)
    (ml,) = client.search_runs([client.get_experiment_by_name("atlas-grpo").experiment_id])
    history = client.get_metric_history(ml.info.run_id, "atlas/loss")
    assert [(m.step, m.value) for m in history] == list(zip(steps, values))
    assert {m.step: m.value for m in client.get_metric_history(ml.info.run_id, "eval_reward")} == rewards
    assert ml.data.tags["atlas.stage"] == recs[-1]["stage"]
    mismatch = client.get_metric_history(ml.info.run_id, "atlas/rollout/mismatch_mean")
    assert sorted(m.step for m in mismatch) == list(range(1, STEPS + 1))
    for rec in recs[1:]:
        path = client.download_artifacts(ml.info.run_id, f"atlas/gates/step_{rec['step']:08d}.json", str(tmp_path))
        saved = json.loads(Path(path).read_text())
        assert (saved["loss_key"], saved["objective_direction"], saved["loss_trend"]) == (
            "eval_reward", "maximize", rec["loss_trend"])
