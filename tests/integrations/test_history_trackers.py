"""One history through a chain of resumes, with real trackers: W&B offline files read back with wandb's records
and MLflow on sqlite hold exactly the local record's gates after every resume (issue 17, must-show)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
from atlas_tracking.integrations.lightning import AtlasCallback
from lightning.pytorch.callbacks import ModelCheckpoint

from atlas_tracking import Canary
from atlas_tracking.artifacts.history import read_history, read_lines
from atlas_tracking.testing.record_checks import assert_receipts_match
from atlas_tracking.testing.tiny import PROSE, QUIET, tiny_canary, tiny_data, tiny_module

warnings.filterwarnings("ignore", ".*does not have many workers.*")


@pytest.fixture(autouse=True)
def _offline_env(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))


def _fit(root, max_steps, canary, ckpt_path, seed):
    import wandb
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

    wandb_logger = WandbLogger(project="atlas-history", save_dir=str(root), offline=True)
    mlflow_logger = MLFlowLogger(experiment_name="atlas-history", tracking_uri=f"sqlite:///{root / 'mlflow.db'}",
                                 artifact_location=str(root / "mlartifacts"))
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", filename="{step}", every_n_train_steps=10, save_top_k=-1,
                           save_last=True)
    train, val = tiny_data(80, seed=seed)
    # every fit must end with both trackers holding the history: the end of training waits for the delivery however
    # slow the machine (the bounded wait, gate.delivery_wait_s, is tests/integrations/test_tracker_stall.py's)
    callback = AtlasCallback(canary=canary, config={**QUIET, "gate": {"delivery_wait_s": 600}})
    trainer = pl.Trainer(max_steps=max_steps, val_check_interval=10, check_val_every_n_epoch=None,
                         logger=[wandb_logger, mlflow_logger], default_root_dir=str(root), callbacks=[callback, ckpt],
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         accelerator="cpu", devices=1, log_every_n_steps=5)
    trainer.fit(tiny_module(), train, val, ckpt_path=ckpt_path)
    run_dir = Path(wandb_logger.experiment.dir).parent
    wandb.finish()
    return callback, run_dir, mlflow_logger.run_id


def _wandb_gates(run_dir):
    from atlas_tracking.testing.wandb_offline import wait_for_offline_run

    data = wait_for_offline_run(run_dir)
    assert data["complete"]
    return [(row["trainer/global_step"], row["atlas/gate_seconds"]) for row in data["history"]
            if "atlas/gate_seconds" in row]


def _mlflow_gates(root, run_id):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, "atlas/gate_seconds"))


@pytest.mark.slow
def test_resume_chain_keeps_one_history_in_the_record_and_the_trackers(tmp_path):
    atlas = tmp_path / "atlas"
    canary, other = tiny_canary(), Canary.from_token_ids(PROSE[400_000:], window=32, n_windows=8, seed=1)
    chain = [  # (max_steps, checkpoint to resume from, canary, data seed)
        (40, None, canary, 0),
        (50, "step=20.ckpt", canary, 1),   # from an older checkpoint
        (60, "last.ckpt", canary, 2),      # from the latest
        (70, "last.ckpt", canary, 3),      # from the latest again
        (80, "last.ckpt", other, 4),       # with another canary
    ]
    written: set[tuple[int, str]] = set()
    expected_steps = [
        [0, 10, 20, 30, 40], [0, 10, 20, 30, 40, 50], [0, 10, 20, 30, 40, 50, 60],
        [0, 10, 20, 30, 40, 50, 60, 70], [0, 10, 20, 30, 40, 50, 60, 70, 80],
    ]
    for (max_steps, ckpt, can, seed), steps in zip(chain, expected_steps):
        callback, run_dir, mlflow_run = _fit(tmp_path, max_steps, can, ckpt and str(tmp_path / "ckpt" / ckpt), seed)
        history = read_history(tmp_path)
        raw = read_lines(atlas / "gates.jsonl")
        abandoned = read_lines(atlas / "gates.abandoned.jsonl")
        assert [r["step"] for r in history] == steps and raw == history
        every = {(r["step"], r["branch"]) for r in history + abandoned}
        assert len(every) == len(history) + len(abandoned)  # nothing twice
        written |= {(r["step"], r["branch"]) for r in raw}
        assert written <= every  # nothing lost: every gate ever written is in the history or set aside
        assert_receipts_match(atlas, history)
        gates = [(r["log_step"], r["gate_seconds"]) for r in history]
        assert _wandb_gates(run_dir) == gates  # a new tracker run catches up with the whole history
        assert _mlflow_gates(tmp_path, mlflow_run) == sorted(gates)
        if ckpt is not None:  # both new tracker runs (W&B, MLflow) received the history up to the restored step
            restored = sum(1 for r in history if r["branch"] != history[-1]["branch"])
            assert callback.resume_counts["redelivered"] == 2 * restored
    abandoned = read_lines(atlas / "gates.abandoned.jsonl")
    assert [r["step"] for r in abandoned] == [30, 40]  # the first branch's gates after the step-20 checkpoint
    rebase = read_history(tmp_path)[-1]
    assert rebase["canary_fingerprint"] == other.fingerprint and rebase["canary_changed_from"] == canary.fingerprint
    assert rebase["status"] == "BASELINE" and rebase["resume"]
    assert len({r["run_id"] for r in read_history(tmp_path)}) == 1
    assert json.loads((atlas / "run.json").read_text())["run_id"] == rebase["run_id"]
