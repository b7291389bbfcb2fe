"""The same checks everywhere (issue 17, item 4): canary vs model, canary type and loss source are checked
alike by the Lightning callback, ``AtlasGate`` and the command line; validate/test run a gate."""

from __future__ import annotations

import json
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from atlas_tracking.integrations.lightning import AtlasCallback

from atlas_tracking import Canary, CanaryError
from atlas_tracking.cli import main as cli
from atlas_tracking.gate import AtlasGate
from atlas_tracking.testing.lightning_lm import MoELM
from atlas_tracking.testing.tiny import POST_TRAINING, PROSE, QUIET, tiny_canary, tiny_data, tiny_module

warnings.filterwarnings("ignore", ".*does not have many workers.*")


def _trainer(root, steps, callbacks, **kw):
    kw.setdefault("enable_checkpointing", False)
    return pl.Trainer(max_steps=steps, val_check_interval=10, check_val_every_n_epoch=None, logger=False,
                      default_root_dir=str(root), callbacks=callbacks, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1, **kw)


def _records(root, name="gates.jsonl"):
    path = root / "atlas" / name
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


LONG = Canary.from_token_ids(PROSE[300_000:], window=600, n_windows=2, seed=0)
"""Windows of 600 tokens: longer than the tiny model's context (max_position_embeddings=512)."""


def test_canary_longer_than_the_context_is_refused_by_callback_gate_and_cli(tmp_path):
    module = tiny_module()
    train, val = tiny_data(30)
    with pytest.raises(CanaryError, match=r"window length 600 exceeds the model's context "
                                          r"\(model\.config\.max_position_embeddings=512\)"):
        _trainer(tmp_path, 30, [AtlasCallback(canary=LONG, config=QUIET)]).fit(module, train, val)
    assert _records(tmp_path) == []
    with pytest.raises(CanaryError, match=r"\(model\.config\.max_position_embeddings=512\)"):
        AtlasGate(module, LONG, QUIET, out_dir=tmp_path / "plain")
    module.model.save_pretrained(tmp_path / "hf")
    LONG.save(tmp_path / "long.npz")
    assert cli(["measure", "--model", str(tmp_path / "hf"), "--canary", str(tmp_path / "long.npz"),
                "--out", str(tmp_path / "r.json"), "--quiet"]) == 2
    assert not (tmp_path / "r.json").exists()


def test_limits_are_found_in_wrappers_and_in_models_without_config():
    from atlas_tracking.engine.canary import model_limits

    limits = model_limits(tiny_module())
    assert (limits["vocab_size"], limits["context"]) == (256, 512)
    assert limits["context_where"] == "model.config.max_position_embeddings"

    class NoConfig(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(50, 8)
            self.block = torch.nn.Linear(8, 8)
            self.block_size = 16

    limits = model_limits(NoConfig())
    assert limits == {"vocab_size": 50, "vocab_where": "tok.num_embeddings", "context": 16,
                      "context_where": "model.block_size"}


@pytest.mark.parametrize("bad", [None, 3, [[1, 2]]])
def test_canary_of_the_wrong_type_is_a_clear_error(bad):
    with pytest.raises(CanaryError, match=r"canary must be a Canary, a \[n_windows, window\] array of token ids, or "
                                          r"the path of a saved canary"):
        AtlasCallback(canary=bad)
    with pytest.raises(CanaryError, match="canary must be a Canary"):
        AtlasGate(tiny_module(), bad, QUIET)


class ValCE(MoELM):
    """Validation logs ``val_ce``, not ``val_loss``; training logs ``train_loss``."""

    def validation_step(self, batch, batch_idx):
        out = self.model(input_ids=batch, labels=batch)
        self.log("val_ce", out.loss, on_epoch=True, batch_size=batch.shape[0])

    def test_step(self, batch, batch_idx):
        out = self.model(input_ids=batch, labels=batch)
        self.log("test_loss", out.loss, on_epoch=True, batch_size=batch.shape[0])


def _val_ce():
    from atlas_tracking.testing.lightning_lm import build_qwen3_moe

    return ValCE(build_qwen3_moe(seed=0, hidden=32, layers=2, experts=8), lr=3e-3)


def test_missing_loss_key_is_a_warning_naming_the_metrics_never_the_training_loss(tmp_path):
    train, val = tiny_data(20)
    with pytest.warns(UserWarning, match=r"no validation loss for the gate: any of val_loss, .* is not among the "
                                         r"logged metrics \[train_loss, val_ce\]"):
        _trainer(tmp_path, 20, [AtlasCallback(canary=tiny_canary(), config=QUIET)]).fit(_val_ce(), train, val)
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [0, 10, 20] and all(r["loss"] is None for r in records)
    named = tmp_path / "named"
    cb = AtlasCallback(canary=tiny_canary(), config=QUIET, loss_key="val_ce")
    trainer = _trainer(named, 20, [cb])
    trainer.fit(_val_ce(), train, val)
    assert all(r["loss"] is not None for r in _records(named)[1:])
    assert _records(named)[-1]["loss"] == pytest.approx(float(trainer.callback_metrics["val_ce"]))


def test_a_named_metric_the_validation_did_not_log_fails_the_gate_and_training_goes_on(tmp_path):
    train, val = tiny_data(20)
    cb = AtlasCallback(canary=tiny_canary(), config={**QUIET, "objective": {"metric": "val_acc"}})
    with pytest.warns(UserWarning, match=r"atlas gate at step 10 failed and was skipped: MissingObjectiveError: the "
                                         r"objective 'val_acc' is not among the metrics the validation logged "
                                         r"\[train_loss, val_ce\]"):
        trainer = _trainer(tmp_path, 20, [cb])
        trainer.fit(_val_ce(), train, val)
    assert trainer.global_step == 20 and [r["step"] for r in _records(tmp_path)] == [0]
    assert _records(tmp_path)[0]["objective_direction"] == "maximize"  # val_acc: an accuracy, maximised
    errors = _records(tmp_path, "errors.jsonl")
    assert [e["step"] for e in errors] == [10, 20] and [e["alerts"][0]["level"] for e in errors] == ["ERROR"] * 2
    assert "[train_loss, val_ce]" in errors[0]["error"]


def test_validate_and_test_run_a_gate_outside_the_history(tmp_path):
    train, val = tiny_data(20)
    cb = AtlasCallback(canary=tiny_canary(), config=POST_TRAINING, loss_key=None)
    trainer = _trainer(tmp_path, 20, [cb])
    module = _val_ce()
    trainer.fit(module, train, val)
    history = _records(tmp_path)
    stage = history[-1]["stage"]
    with pytest.warns(UserWarning, match=r"no validate loss"):
        trainer.validate(module, val)
    trainer.test(module, val)
    evaluations = _records(tmp_path, "evaluations.jsonl")
    assert [(e["kind"], e["step"]) for e in evaluations] == [("validate", 20), ("test", 20)]
    assert evaluations[1]["loss"] == pytest.approx(float(trainer.callback_metrics["test_loss"]))
    assert evaluations[0]["status"] in ("GREEN", "YELLOW", "RED") and evaluations[0]["baseline_step"] == 0
    assert _records(tmp_path) == history and cb.gate.policy.stage == stage  # the run's history did not move


def test_validate_alone_runs_a_gate(tmp_path):
    """``trainer.validate()`` without a fit (no baseline yet): a gate is measured and written, not skipped."""
    _, val = tiny_data(10)
    trainer = _trainer(tmp_path, 10, [AtlasCallback(canary=tiny_canary(), config=QUIET)])
    trainer.validate(tiny_module(), val)
    (evaluation,) = _records(tmp_path, "evaluations.jsonl")
    assert evaluation["kind"] == "validate" and evaluation["step"] == 0 and evaluation["loss"] is not None
    assert evaluation["c2"] is not None and not (tmp_path / "atlas" / "gates.jsonl").exists()
    assert np.isfinite(evaluation["canary_nll"])


def test_validate_from_a_checkpoint_reads_against_that_runs_state(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    train, val = tiny_data(20)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=10)
    _trainer(tmp_path, 20, [AtlasCallback(canary=tiny_canary(), config=POST_TRAINING), ckpt],
             enable_checkpointing=True).fit(tiny_module(), train, val)
    history = _records(tmp_path)
    trainer = _trainer(tmp_path, 20, [AtlasCallback(canary=tiny_canary(), config=POST_TRAINING)])
    trainer.validate(tiny_module(seed=3), val, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    (evaluation,) = _records(tmp_path, "evaluations.jsonl")
    assert evaluation["step"] == 20 and evaluation["baseline_step"] == 0 and evaluation["status"] != "BASELINE"
    assert evaluation["run_id"] == history[0]["run_id"] and _records(tmp_path) == history
