"""AtlasCallback in a real Lightning fit: gates, local record, baseline, resume, failures, CLI config."""

from __future__ import annotations

import json
import warnings

import lightning.pytorch as pl
import pytest
import torch
from atlas_tracking.integrations.lightning import AtlasCallback
from lightning.pytorch.callbacks import ModelCheckpoint

from atlas_tracking.artifacts.gate_report import read_artifact, verify
from atlas_tracking.testing.tiny import QUIET, tiny_canary, tiny_data, tiny_module

warnings.filterwarnings("ignore", ".*does not have many workers.*")


def _trainer(root, max_steps, callbacks, **kw):
    return pl.Trainer(
        max_steps=max_steps, val_check_interval=10, check_val_every_n_epoch=None, logger=False,
        default_root_dir=str(root), callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=1, accelerator="cpu", devices=1, **kw,
    )


def _records(root):
    return [json.loads(line) for line in (root / "atlas" / "gates.jsonl").read_text().splitlines()]


def test_fit_writes_gates_baseline_and_verifiable_receipts(tmp_path):
    torch.manual_seed(0)
    cb = AtlasCallback(canary=tiny_canary(), config=QUIET)
    train, val = tiny_data(30)
    _trainer(tmp_path, 30, [cb], enable_checkpointing=False).fit(tiny_module(), train, val)
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [0, 10, 20, 30]
    assert records[0]["status"] == "BASELINE" and records[0]["loss"] is None
    assert all(r["status"] != "BASELINE" for r in records[1:])
    assert (tmp_path / "atlas" / "baseline" / "manifest.json").exists()
    assert all(r["loss"] is not None and r["canary_fingerprint"] == tiny_canary().fingerprint for r in records[1:])
    for step in (10, 20, 30):
        assert verify(read_artifact(tmp_path / "atlas" / "receipts" / f"step_{step:08d}.json")) == []
    assert records[1]["refine_margin"] is not None and "coord_drift" in records[1]["layers"][0]


def test_every_n_validations_and_no_sanity_gate(tmp_path):
    cfg = {**QUIET, "gate": {"every_n_validations": 2, "baseline_at_start": False}}
    cb = AtlasCallback(canary=tiny_canary(), config=cfg)
    train, val = tiny_data(40)
    _trainer(tmp_path, 40, [cb], enable_checkpointing=False).fit(tiny_module(), train, val)
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [20, 40] and records[0]["status"] == "BASELINE"


def test_resume_gate_is_a_baseline_and_no_record_is_duplicated_or_lost(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=10)
    train, val = tiny_data(40)
    _trainer(tmp_path, 20, [AtlasCallback(canary=tiny_canary(), config=QUIET), ckpt]).fit(tiny_module(), train, val)
    before = _records(tmp_path)
    assert [r["step"] for r in before] == [0, 10, 20]
    cb2 = AtlasCallback(canary=tiny_canary(), config=QUIET)
    ckpt2 = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=10)
    _trainer(tmp_path, 40, [cb2, ckpt2]).fit(tiny_module(seed=1), train, val, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [0, 10, 20, 30, 40]
    assert records[3]["status"] == "BASELINE" and records[3]["resume"] is True
    assert records[3]["stage_before_resume"] == before[2]["stage"]
    assert any(a["key"] == "resume_baseline" for a in records[3]["alerts"])
    assert records[4]["status"] in ("GREEN", "YELLOW", "RED") and records[4]["baseline_step"] == 30


def test_failing_gate_does_not_stop_training(tmp_path):
    def broken_forward(model, ids):
        raise RuntimeError("forward failed")  # any failure inside a gate

    class Broken(AtlasCallback):
        def on_fit_start(self, trainer, pl_module):
            super().on_fit_start(trainer, pl_module)
            self.gate.forward = broken_forward

    train, val = tiny_data(20)
    with pytest.warns(UserWarning, match="atlas gate at step 0 failed"):
        _trainer(tmp_path, 20, [Broken(canary=tiny_canary(), config=QUIET)], enable_checkpointing=False).fit(
            tiny_module(), train, val)
    errors = (tmp_path / "atlas" / "errors.jsonl").read_text().splitlines()
    assert [json.loads(e)["step"] for e in errors] == [0, 10, 20]


def test_model_without_routed_layers_is_a_clear_error(tmp_path):
    class Plain(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match="no routed MoE layer found"):
        AtlasCallback(canary=tiny_canary()).setup(_trainer(tmp_path, 1, []), Plain(), "fit")
