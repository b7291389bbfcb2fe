"""A gate in a mixed-precision run computes in the run's validation precision (docs/receipts.md#precision).

Under Lightning ``precision="bf16-mixed"`` the callback runs its gates in the trainer's validation precision
context, and under the transformers Trainer's ``bf16=True`` the model's forward carries the autocast itself:
either way the gate's forward is the one the run validates with, which the artifact shows in its self-check
tolerance (that of bf16 once the model's forward went through it; fp32 runs keep fp32's, as every other test shows).
"""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from atlas_tracking.integrations.lightning import AtlasCallback
from atlas_tracking.integrations.transformers import AtlasTrainerCallback
from transformers import Trainer

from atlas_tracking.engine.selfcheck import TOLERANCE
from atlas_tracking.testing.tiny import QUIET, tiny_canary, tiny_data, tiny_module
from atlas_tracking.testing.trainer import tiny_model, tiny_sets, trainer_args

BF16 = TOLERANCE[torch.bfloat16]


def _tolerances(atlas_dir) -> list[float]:
    """Every gate's per-layer self-check tolerances, from the per-gate receipts artifacts."""
    files = sorted((atlas_dir / "receipts").glob("step_*.json"))
    assert files
    return [lay["selfcheck"]["tolerance"] for f in files for lay in json.loads(f.read_text())["layers"]]


@pytest.mark.parametrize(("precision", "expected"), [("bf16-mixed", BF16)])
def test_lightning_gate_runs_in_the_validation_precision(tmp_path, precision, expected):
    train, val = tiny_data(10)
    trainer = pl.Trainer(max_steps=10, val_check_interval=10, check_val_every_n_epoch=None, logger=False,
                         default_root_dir=str(tmp_path), enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, accelerator="cpu", devices=1, enable_checkpointing=False,
                         precision=precision, callbacks=[AtlasCallback(canary=tiny_canary(), config=QUIET)])
    trainer.fit(tiny_module(), train, val)
    assert _tolerances(tmp_path / "atlas") == pytest.approx([expected] * len(_tolerances(tmp_path / "atlas")))


@pytest.mark.parametrize(("bf16", "expected"), [(True, BF16)])
def test_trainer_gate_runs_in_the_trainers_precision(tmp_path, bf16, expected):
    out = tmp_path / "out"
    train, val = tiny_sets(10)
    trainer = Trainer(tiny_model(), args=trainer_args(out, 10, eval_steps=5, bf16=bf16), train_dataset=train,
                      eval_dataset=val)
    trainer.add_callback(AtlasTrainerCallback(canary=tiny_canary(), config=QUIET))
    trainer.train()
    tolerances = _tolerances(out / "atlas")
    assert tolerances == pytest.approx([expected] * len(tolerances))
