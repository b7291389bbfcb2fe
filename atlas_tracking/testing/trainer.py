"""The transformers Trainer and TRL set-up the tests share: byte windows, arguments, trackers read back, LoRA, DDP."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from atlas_tracking.testing.lightning_lm import ByteWindows, build_qwen3_moe
from atlas_tracking.testing.tiny import POST_TRAINING, PROSE, QUIET, tiny_canary


class Windows(ByteWindows):
    """The demo's byte windows as the Trainer's ``input_ids``/``labels``."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = super().__getitem__(i)
        return {"input_ids": ids, "labels": ids.clone()}


def tiny_model(seed: int = 0, aux_coef: float = 0.02):
    return build_qwen3_moe(seed=seed, hidden=32, layers=2, experts=8, aux_coef=aux_coef)


def model_from_checkpoint(checkpoint: Path):
    """The model of a Trainer checkpoint, read with ``from_pretrained``.

    transformers 5.23's ``Trainer._load_from_checkpoint`` reads ``model.safetensors`` with a plain
    ``load_state_dict(strict=False)``, while ``save_pretrained`` writes a Qwen3-MoE's fused experts as
    per-expert tensors: a resume onto a freshly built model leaves every expert (and nothing else) as built,
    with only a "missing keys" warning. ``from_pretrained`` converts them back; the Trainer's own load then
    rewrites the other weights with the same values.
    """
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)


def tiny_sets(steps: int, batch: int = 8, seed: int = 0) -> tuple[Windows, Windows]:
    return Windows(PROSE[:200_000], 32, steps * batch, seed), Windows(PROSE[200_000:260_000], 32, 8, seed + 1)


def trainer_args(out: Path, steps: int, *, eval_steps: int = 10, save_steps: int | None = None, **overrides: Any):
    """``TrainingArguments`` for a short CPU fit: batch 8, constant learning rate, no trackers; ``overrides`` win."""
    from transformers import TrainingArguments

    args: dict[str, Any] = dict(
        output_dir=str(out), max_steps=steps, eval_strategy="steps", eval_steps=eval_steps,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, per_device_train_batch_size=8,
        per_device_eval_batch_size=8, learning_rate=3e-3, lr_scheduler_type="constant", report_to="none",
        use_cpu=True, logging_steps=eval_steps, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    return TrainingArguments(**{**args, **overrides})


def records(out: Path, name: str = "gates.jsonl") -> list[dict[str, Any]]:
    path = Path(out) / "atlas" / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def use_trackers(monkeypatch, tmp_path: Path, experiment: str = "atlas-trainer") -> str:
    """W&B offline under ``tmp_path`` and MLflow on sqlite there (artifacts there too); returns the tracking URI.

    W&B's process-wide settings are reset first: a run started earlier in this process (by any test) would
    otherwise keep its ``WANDB_DIR``."""
    from mlflow.tracking import MlflowClient

    finish_trackers()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", experiment)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", experiment)
    MlflowClient(tracking_uri=uri).create_experiment(experiment, artifact_location=str(tmp_path / "mlartifacts"))
    import mlflow

    mlflow.set_tracking_uri(uri)
    return uri


def finish_trackers() -> None:
    """End the runs the Trainer's integrations leave open (W&B) or may leave open (MLflow), and reset W&B's
    process-wide settings so that the next run reads ``WANDB_DIR`` again."""
    import mlflow
    import wandb

    if wandb.run is not None:
        wandb.finish()
    wandb.teardown()
    while mlflow.active_run() is not None:
        mlflow.end_run()


def wandb_runs(tmp_path: Path) -> list[dict[str, Any]]:
    """Every offline W&B run under ``tmp_path``, read back with wandb's own records, oldest first."""
    from atlas_tracking.testing.wandb_offline import wait_for_offline_run

    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    return [wait_for_offline_run(r) for r in runs]


LORA_TARGETS = {
    "experts": {"target_modules": [], "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]},
    "attention": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
}
"""PEFT LoRA on the fused routed experts' parameters, or on the attention projections only (router, experts and
norms frozen either way)."""


def lora_model(target: str, seed: int = 0):
    """The tiny Qwen3-MoE wrapped by ``peft.get_peft_model`` with LoRA (rank 4) on ``LORA_TARGETS[target]``."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_model(seed=seed), LoraConfig(r=4, lora_alpha=8, **LORA_TARGETS[target]))


DDP_CONFIG = {**POST_TRAINING, "receipts": {**QUIET["receipts"], "batch_windows": 2}}
"""Two canary windows per micro-batch: the 8-window canary is measured 2 micro-batches per process on 2 processes."""


def ddp_fit(rank: int, world: int, out: str, steps: int, eval_steps: int) -> dict[str, Any]:
    """A gloo worker (:func:`atlas_tracking.testing.distributed.run_workers`): a Trainer fit with the callback on ``world`` processes.

    The Trainer runs DDP through accelerate; ``split_batches`` gives every step the batch of one process (8
    windows, 4 per process). Rank zero saves the trained weights (``weights.safetensors``); every rank returns
    its last gate record.
    """
    from safetensors.torch import save_model
    from transformers import Trainer

    from atlas_tracking.integrations.transformers import AtlasTrainerCallback

    train, val = tiny_sets(steps)
    callback = AtlasTrainerCallback(canary=tiny_canary(), config=DDP_CONFIG)
    model = tiny_model(aux_coef=0.0)  # the load-balancing loss of a rank's half batch is not half the batch's
    trainer = Trainer(model, args=trainer_args(Path(out), steps, eval_steps=eval_steps,
                                               accelerator_config={"split_batches": True}),
                      train_dataset=train, eval_dataset=val, callbacks=[callback])
    trainer.train()
    if rank == 0:
        save_model(model, str(Path(out) / "weights.safetensors"))
    record = dict(callback.last_record or {})
    for own in ("receipts_sha256", "gate_seconds", "gate_share"):  # rank zero's file checksum; each rank's own wall times
        record.pop(own, None)
    return {"world": trainer.args.world_size, "last": record}
