"""DDP on 2 CPU processes (gloo): every rank measures its share of the canary; receipts equal 1 process within the
stated tolerances (docs/receipts.md#tolerances-across-world-sizes): the batch layout and thread count differ, so the floats
differ in their last digits."""

from __future__ import annotations

import json
import warnings

import lightning.pytorch as pl
import pytest
from atlas_tracking.integrations.lightning import AtlasCallback

from atlas_tracking.testing.tiny import QUIET, tiny_canary, tiny_data, tiny_module
from atlas_tracking.testing.tolerance import assert_within_tolerance

warnings.filterwarnings("ignore", ".*does not have many workers.*")


def _fit(root, devices: int) -> None:
    train, val = tiny_data(10)
    trainer = pl.Trainer(
        max_steps=10, val_check_interval=10, check_val_every_n_epoch=None, logger=False, default_root_dir=str(root),
        callbacks=[AtlasCallback(canary=tiny_canary(), config={**QUIET, "receipts": {**QUIET["receipts"],
                                                                                     "batch_windows": 2}})],
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu",
        devices=devices, strategy="ddp_spawn" if devices > 1 else "auto", enable_checkpointing=False,
    )
    # transformers' router-logit recording does not survive ddp_spawn's pickling: no aux loss here
    trainer.fit(tiny_module(aux_coef=0.0), train, val)


@pytest.mark.slow
def test_two_process_ddp_receipts_agree_with_one_process(tmp_path):
    _fit(tmp_path / "one", 1)
    _fit(tmp_path / "two", 2)
    one = json.loads((tmp_path / "one" / "atlas" / "receipts" / "step_00000000.json").read_text())
    two = json.loads((tmp_path / "two" / "atlas" / "receipts" / "step_00000000.json").read_text())
    assert_within_tolerance(one, two)
    gates = (tmp_path / "two" / "atlas" / "gates.jsonl").read_text().splitlines()
    assert [json.loads(g)["step"] for g in gates] == [0, 10]  # rank zero writes each gate once
