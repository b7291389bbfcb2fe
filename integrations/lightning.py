"""``AtlasCallback``: atlas gates at validation time in a Lightning ``Trainer``.

Thin glue: Lightning hooks map to calls on :class:`atlas_tracking.gate.AtlasGate`, which owns
measurement, baseline, policy, alerts, the local ``<default_root_dir>/atlas/gates.jsonl``
record and tracker delivery. Trackers are picked up from ``trainer.loggers`` (``WandbLogger``,
``MLFlowLogger``; any other logger, ``TensorBoardLogger`` or ``CSVLogger``, gets the scalar receipts
through ``log_metrics``) or given explicitly, and receive each gate at the step Lightning logs the
validation metrics at. A failing gate never stops training: it is written to
``atlas/errors.jsonl`` and reported as a warning. ``trainer.fit(..., ckpt_path=...)`` resumes
the run's record (:meth:`AtlasGate.resume`); ``trainer.validate()`` and ``trainer.test()`` run a
gate outside the training history (``atlas/evaluations.jsonl``)::
    from atlas_tracking.integrations.lightning import AtlasCallback
    trainer = L.Trainer(callbacks=[AtlasCallback(canary="canary.npz", config="atlas.yaml")],
                        logger=[WandbLogger(...), MLFlowLogger(tracking_uri="sqlite:///mlflow.db")])
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from atlas_tracking.integrations.mlflow import MlflowSink
from atlas_tracking.integrations.wandb import WandbSink
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from atlas_tracking.callbacks import LossSource, ValidationGates
from atlas_tracking.engine.canary import Canary
from atlas_tracking.engine.measure import default_forward
from atlas_tracking.gate import AtlasGate
from atlas_tracking.schema.config import AtlasConfig
from atlas_tracking.schema.record import Stage, Status
from atlas_tracking.sinks.console import LoggingSink
from atlas_tracking.sinks.metrics_logger import LogMetricsSink

log = logging.getLogger("lightning.pytorch.callbacks.atlas")

VALIDATION_LOSS_KEYS = ("val_loss", "val/loss", "validation_loss", "validation/loss", "valid_loss")
"""Validation loss names read when ``loss_key`` is not given (never a training loss)."""
TEST_LOSS_KEYS = ("test_loss", "test/loss")
"""Test loss names read by ``trainer.test()`` gates when ``loss_key`` is not given."""


def _forward_target(module: torch.nn.Module) -> torch.nn.Module:
    """The submodule to call with ``input_ids``: the first transformers-style model inside, else the module."""
    for sub in module.modules():
        if hasattr(sub, "config") and hasattr(sub, "get_input_embeddings"):
            return sub
    return module


def tracker_sinks(loggers: list[Any]) -> list[Any]:
    """A sink for each of the trainer's loggers: W&B and MLflow get their own, any other logger with
    ``log_metrics`` (``TensorBoardLogger``, ``CSVLogger``, ...) the scalar receipts.

    >>> from lightning.pytorch.loggers import CSVLogger
    >>> [s.name for s in tracker_sinks([CSVLogger("logs"), CSVLogger("logs", name="b"), object()])]
    ['CSVLogger', 'CSVLogger#2']
    """
    sinks: list[Any] = []
    for logger in loggers:
        kind = type(logger).__name__
        if kind == "WandbLogger":
            sinks.append(WandbSink(logger=logger))
        elif kind == "MLFlowLogger":
            sinks.append(MlflowSink(logger=logger))
        elif callable(getattr(logger, "log_metrics", None)):
            same = sum(1 for s in sinks if isinstance(s, LogMetricsSink) and type(s.logger) is type(logger))
            sinks.append(LogMetricsSink(logger, name=f"{kind}#{same + 1}" if same else kind))
    return sinks


def _run_ids(loggers: list[Any]) -> dict[str, str]:
    ids: dict[str, str] = {}
    for logger in loggers:
        try:
            if type(logger).__name__ == "WandbLogger":
                ids["wandb"] = str(logger.experiment.id)
            elif type(logger).__name__ == "MLFlowLogger":
                ids["mlflow"] = str(logger.run_id)
        except Exception:  # a tracker that is down must not break checkpointing
            continue
    return ids


def logger_step(trainer: pl.Trainer) -> int:
    """The step Lightning logs metrics at (``val_loss`` included): its count of batches that stepped.

    Lightning's logger connector logs at ``fit_loop.epoch_loop._batches_that_stepped``, which
    during a validation inside the training loop is one less than ``global_step`` (the count is
    increased after validation); ``WandbLogger`` plots it as ``trainer/global_step`` and
    ``MLFlowLogger`` as the metric step. Gates are delivered at this step so they line up with
    ``val_loss``; the record keeps ``global_step`` as its key.
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    value = getattr(loop, "_batches_that_stepped", None)
    return int(value) if isinstance(value, int) else int(trainer.global_step)



def validation_precision(trainer: pl.Trainer) -> Any:
    """The precision context of the trainer's validation steps (autocast under ``precision="bf16-mixed"``), in
    which a gate's forward computes and routes as the run's own validation does (docs/receipts.md#precision)."""
    return trainer.precision_plugin.val_step_context()

class AtlasCallback(pl.Callback):
    """Run an atlas gate after validation, every ``every_n_validations`` (never in the sanity check).

    Args:
        canary: a :class:`~atlas_tracking.Canary` or the path of a saved one (``.npz``/``.npy``).
        config: an :class:`~atlas_tracking.AtlasConfig`, a dict, or a YAML path.
        out_dir: where the baseline and gate records go (default ``<default_root_dir>/atlas``).
        sinks: extra sinks; the trainer's loggers are added automatically (:func:`tracker_sinks`).
        loss_key: the ``trainer.callback_metrics`` key read as the gate's objective, as ``objective.metric`` names
            it (default: the first of ``val_loss``, ``val/loss``, ``validation_loss``, ``validation/loss``,
            ``valid_loss``; in ``trainer.test()`` ``test_loss``, ``test/loss``; its direction is
            ``objective.direction``, else the metric's default: ``val_acc`` is maximised). A named metric that a
            validation in training did not log fails that gate with an error naming the metrics that were (training
            goes on); a default that is not logged leaves the gate's loss empty with a warning naming them. A
            training loss is never read instead.
    """

    def __init__(
        self,
        canary: Canary | str,
        config: AtlasConfig | dict | str | None = None,
        out_dir: str | None = None,
        sinks: list[Any] | None = None,
        loss_key: str | None = None,
    ):
        super().__init__()
        try:
            self.canary = Canary.coerce(canary)
            self.config = AtlasConfig.coerce(config)
            self.losses = LossSource({"validation": VALIDATION_LOSS_KEYS, "validate": VALIDATION_LOSS_KEYS,
                                      "test": TEST_LOSS_KEYS}, loss_key, objective=self.config.objective,
                                     hint="Pass AtlasCallback(loss_key=...) to name the metric to read.",
                                     warn=rank_zero_warn)
        except ValueError as exc:
            # said once, first: a LightningCLI prints the exception below a long parser traceback
            log.error("atlas: AtlasCallback cannot start: %s", exc)
            raise
        self.out_dir = out_dir
        self.extra_sinks = list(sinks or [])
        self.loss_key = loss_key
        self.gates = ValidationGates(warn=rank_zero_warn, source=self.losses)
        self._checkpoint_step = 0
        self._stepped = -1
        """The last optimizer step whose end was handed to the gate."""

    gate = property(lambda self: self.gates.gate)
    last_record = property(lambda self: self.gates.last_record)
    resume_counts = property(lambda self: self.gates.resume_counts)
    """What the last resume did: gates moved aside, caught up, re-delivered to trackers."""

    # --- set-up ------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        if self.gate is not None:
            return
        target = _forward_target(pl_module)
        out_dir = Path(self.out_dir) if self.out_dir else Path(trainer.default_root_dir) / "atlas"
        sinks = [*tracker_sinks(trainer.loggers), *self.extra_sinks, LoggingSink(log)]
        self.gates.attach(AtlasGate(
            pl_module, self.canary, self.config, out_dir=out_dir, sinks=sinks,
            forward=lambda _model, ids: default_forward(target, ids),
        ))
        if self.gate.telemetry is not None:  # intervals at the trainer's logging cadence unless configured
            self.gate.telemetry.follow(trainer.log_every_n_steps)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._checkpoint_step = int(checkpoint.get("global_step") or 0)
        # checkpoints written before the state key was the class name keyed it by the canary
        if self.gates.restored is None:
            for name, state in (checkpoint.get("callbacks") or {}).items():
                if name.startswith("AtlasCallback{'canary'") and state:
                    self.gates.load_state_dict(state)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning restores callback state before on_fit_start but the loop state (global step)
        # only after it, so the restored gate state is applied here.
        self._stepped = int(trainer.global_step)
        with validation_precision(trainer):
            self.gates.start(int(trainer.global_step), log_step=logger_step(trainer))

    # --- between gates -------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """After an optimizer step (the last micro-batch of an accumulation): the training-batch load interval
        closes when it is due."""
        step = int(trainer.global_step)
        if self.gate is not None and step != self._stepped:
            self._stepped = step
            self.gates.step(step, log_step=logger_step(trainer))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """The next optimizer-step boundary: the early gate the alarm asked for, unless a validation gate of the
        step answered it."""
        self._early(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._early(trainer)

    def _early(self, trainer: pl.Trainer) -> None:
        if self.gate is not None and self.gates.early_due():
            with validation_precision(trainer):
                self.gates.early(int(trainer.global_step), log_step=logger_step(trainer))

    # --- gates -------------------------------------------------------------------------------
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self.gate is None:
            return
        if trainer.state.fn == TrainerFn.VALIDATING:
            self._evaluate(trainer, "validate")
            return
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if self.gates.gated(int(trainer.global_step)) or not self.gates.due():
            return
        with validation_precision(trainer):
            record = self.gates.read_run(int(trainer.global_step), trainer.callback_metrics, "validation",
                                         log_step=logger_step(trainer))
        if record is None:
            return
        if self.config.gate.checkpoint_on_green and record.get("status") == Status.GREEN and record.get("stage") == Stage.clean:
            self._save_green(trainer, int(trainer.global_step))

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.gate is not None:
            self._evaluate(trainer, "test")

    def _evaluate(self, trainer: pl.Trainer, kind: str) -> None:
        # validate/test(ckpt_path=...) restore the model and this callback's state but not the loop's step
        step = int(trainer.global_step) or self._checkpoint_step
        with validation_precision(trainer):
            self.gates.evaluate(step, self.losses.read(trainer.callback_metrics, kind), kind)

    def _save_green(self, trainer: pl.Trainer, step: int) -> None:
        """Geometry-aware checkpoint: keep the last N GREEN/clean states (paper 7.5)."""
        assert self.gate is not None
        path = self.gate.out_dir / "green" / f"step={step:08d}.ckpt"
        trainer.save_checkpoint(path)
        self.gates.green.append(str(path))
        while len(self.gates.green) > self.config.gate.keep_green_checkpoints:
            old = Path(self.gates.green.pop(0))
            if trainer.is_global_zero and old.exists():
                old.unlink()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.gates.finish()

    # --- checkpointed state -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        trainer_loggers = getattr(getattr(self, "_trainer", None), "loggers", []) or []
        return self.gates.state_dict(tracker_run_ids=_run_ids(trainer_loggers))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.gates.load_state_dict(state_dict)
