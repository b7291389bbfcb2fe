"""Shared pieces for the transformers Trainer and TRL tests: byte windows, arguments, trackers read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning_helpers import PROSE, QUIET, tiny_canary  # noqa: F401  (re-exported for the Trainer tests)
from moe_lightning import build_qwen3_moe
from torch.utils.data import Dataset


class Windows(Dataset):
    """``length`` windows of ``window`` byte tokens (fixed seed) as the Trainer's ``input_ids``/``labels``."""

    def __init__(self, stream: np.ndarray, window: int, length: int, seed: int):
        rng = np.random.default_rng(seed)
        self.starts = rng.integers(0, len(stream) - window, size=length)
        self.stream, self.window = stream, window

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(self.stream[self.starts[i] : self.starts[i] + self.window].astype(np.int64))
        return {"input_ids": ids, "labels": ids.clone()}


def tiny_model(seed: int = 0, aux_coef: float = 0.02):
    return build_qwen3_moe(seed=seed, hidden=32, layers=2, experts=8, aux_coef=aux_coef)


def tiny_sets(steps: int, batch: int = 8, seed: int = 0) -> tuple[Windows, Windows]:
    return Windows(PROSE[:200_000], 32, steps * batch, seed), Windows(PROSE[200_000:260_000], 32, 8, seed + 1)


def trainer_args(out: Path, steps: int, *, eval_steps: int = 10, save_steps: int | None = None,
                 report_to: list[str] | str = "none", **kw: Any):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out), max_steps=steps, eval_strategy=kw.pop("eval_strategy", "steps"), eval_steps=eval_steps,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, per_device_train_batch_size=8,
        per_device_eval_batch_size=8, learning_rate=3e-3, lr_scheduler_type="constant", report_to=report_to,
        use_cpu=True, logging_steps=eval_steps, disable_tqdm=True, seed=0, dataloader_num_workers=0, **kw)


def records(out: Path, name: str = "gates.jsonl") -> list[dict[str, Any]]:
    path = Path(out) / "atlas" / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def use_trackers(monkeypatch, tmp_path: Path, experiment: str = "atlas-trainer") -> str:
    """W&B offline under ``tmp_path`` and MLflow on sqlite there (artifacts there too); returns the tracking URI."""
    from mlflow.tracking import MlflowClient

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
    """End the runs the Trainer's integrations leave open (W&B) or may leave open (MLflow)."""
    import mlflow
    import wandb

    if wandb.run is not None:
        wandb.finish()
    while mlflow.active_run() is not None:
        mlflow.end_run()


def wandb_runs(tmp_path: Path) -> list[dict[str, Any]]:
    """Every offline W&B run under ``tmp_path``, read back with wandb's own records, oldest first."""
    from atlas_tracking.integrations.wandb import wait_for_offline_run

    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    return [wait_for_offline_run(r) for r in runs]
