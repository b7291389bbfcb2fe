"""``AtlasTrainerCallback``: atlas gates at evaluation time in a transformers ``Trainer`` (and TRL's).

Thin glue, as the Lightning callback is: the Trainer's events map to
:class:`atlas_tracking.callbacks.ValidationGates` around an :class:`atlas_tracking.gate.AtlasGate`,
which owns measurement, baseline, policy, alerts, the local ``<output_dir>/atlas/gates.jsonl``
record (written first) and tracker delivery.

- ``on_train_begin``: the gate is built on the Trainer's model (a PEFT model included: routed layers
  are found through its wrappers), the step-0 baseline is measured before any update, and the
  trackers the Trainer reports to (``report_to``: the active W&B run, the active MLflow run) are
  attached. A resumed ``train(resume_from_checkpoint=...)`` resumes the run's record instead
  (:meth:`AtlasGate.resume`: one history, trackers caught up) and its first gate is a BASELINE.
- ``on_evaluate``: a gate after every ``gate.every_n_validations``-th evaluation step, at the Trainer's
  ``global_step`` (the step its own integrations log ``eval_loss`` at), with ``eval_loss`` as the
  gate's objective, minimised (with several evaluation datasets, once per step, after the one ``loss_key`` names).
  Under TRL's ``GRPOTrainer`` or ``RLOOTrainer``, whose ``eval_loss`` is a policy-gradient surrogate, the objective
  is the mean reward ``eval_reward``, maximised (:func:`surrogate_loss`). A failing gate never stops training
  (``atlas/errors.jsonl`` and a warning); so does a gate whose evaluation lacks the metric the operator named.
  Each gate prints one line on rank zero, as the Lightning callback does (logger ``atlas_tracking.trainer``).
  ``trainer.evaluate()`` outside training writes a gate to ``atlas/evaluations.jsonl`` only.
- State: the callback is an ``ExportableState``; its state goes into every checkpoint's
  ``trainer_state.json`` (JSON: policy, alerts, the history's lineage, cadence; never a secret) and is
  read back from the checkpoint training resumes from whether or not
  ``TrainingArguments.restore_callback_states_from_checkpoint`` is set.

Usage (a sketch; ``tests/integrations/test_transformers_callback.py`` runs it in full)::
    from atlas_tracking.integrations.transformers import AtlasTrainerCallback

    trainer = Trainer(model, args=TrainingArguments(..., eval_strategy="steps", eval_steps=200,
                      report_to=["wandb", "mlflow"]), train_dataset=train, eval_dataset=val)
    trainer.add_callback(AtlasTrainerCallback(canary="canary.npz", config="atlas.yaml"))
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any

from atlas_tracking.integrations.generate_rollouts import trainer_rollouts
from atlas_tracking.integrations.mlflow import MlflowSink
from atlas_tracking.integrations.wandb import WandbSink
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from atlas_tracking.callbacks import LossSource, ValidationGates
from atlas_tracking.engine.canary import Canary
from atlas_tracking.gate import AtlasGate, _is_rank_zero
from atlas_tracking.schema.config import AtlasConfig
from atlas_tracking.sinks.console import LoggingSink

log = logging.getLogger("atlas_tracking")

EVAL_LOSS_KEYS = ("eval_loss",)
"""Evaluation loss names read when ``loss_key`` is not given (never a training loss)."""
REWARD_KEYS = ("eval_reward",)
"""The objective read when ``loss_key`` is not given under a trainer whose logged loss is a surrogate: the mean
reward of the evaluation's completions (maximised: ``objective.direction`` defaults to it for a reward)."""
SURROGATE_CONFIGS = ("GRPOConfig", "RLOOConfig")
"""TRL's training arguments of the trainers whose ``eval_loss`` is a policy-gradient surrogate (flat while the reward
rises) and whose evaluation metrics hold ``eval_reward``: GRPOTrainer and RLOOTrainer (GMPOTrainer and any other
subclass take a subclass of their arguments)."""
TRAINER_STEP_KEY = "train/global_step"
"""The x-axis the transformers ``WandbCallback`` logs every metric against; gates use it too."""


GATE_LINES = "atlas_tracking.trainer"
"""The logger of the one line per gate the Trainer path prints (rank zero only, above the progress bar);
set its level to WARNING to silence it."""


class _ProgressBarHandler(logging.Handler):
    """Writes through ``tqdm.write``, so a line lands above the Trainer's progress bar instead of inside it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        try:
            tqdm.write(self.format(record))
        except Exception:  # a console that cannot be written must never stop training
            self.handleError(record)


def gate_lines() -> logging.Logger:
    """The logger of the per-gate line: INFO, printed once (it does not also propagate to the root logger).

    >>> log = gate_lines()
    >>> log.name, log.level == logging.INFO, log.propagate, sum(isinstance(h, _ProgressBarHandler) for h in log.handlers)
    ('atlas_tracking.trainer', True, False, 1)
    """
    logger = logging.getLogger(GATE_LINES)
    if not any(isinstance(h, _ProgressBarHandler) for h in logger.handlers):
        logger.addHandler(_ProgressBarHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def _warn(message: str) -> None:
    if _is_rank_zero():
        warnings.warn(message, UserWarning, stacklevel=3)


def tracker_sinks(report_to: list[str] | None) -> list[Any]:
    """Sinks for the trackers the Trainer reports to: the active W&B run and the active MLflow run.

    The Trainer's own ``WandbCallback`` / ``MLflowCallback`` start those runs in ``on_train_begin``,
    before any callback added by the user. Call on the main process (the runs live there).
    """
    report_to = list(report_to or [])
    sinks: list[Any] = []
    if "wandb" in report_to:
        import wandb

        if wandb.run is not None:
            sinks.append(WandbSink(run=wandb.run, step_key=TRAINER_STEP_KEY))
        else:
            _warn("atlas: 'wandb' is in report_to but no W&B run is active when training begins; "
                  "gates are kept in the local record only")
    if "mlflow" in report_to:
        import mlflow

        run = mlflow.active_run()
        if run is not None:
            sinks.append(MlflowSink(tracking_uri=mlflow.get_tracking_uri(), run_id=run.info.run_id))
        else:
            _warn("atlas: 'mlflow' is in report_to but no MLflow run is active when training begins; "
                  "gates are kept in the local record only")
    return sinks


def logging_cadence(args: TrainingArguments, state: TrainerState) -> int | None:
    """The optimizer steps between two of the Trainer's logs (``logging_steps``; a fraction of ``max_steps`` when
    below 1), or None when it does not log by steps.

    >>> from types import SimpleNamespace
    >>> logging_cadence(SimpleNamespace(logging_strategy="steps", logging_steps=0.1), SimpleNamespace(max_steps=300))
    30
    """
    if str(getattr(args.logging_strategy, "value", args.logging_strategy)) != "steps":
        return None
    steps = float(args.logging_steps)
    return max(1, math.ceil(steps * state.max_steps)) if steps < 1 else int(steps)


def surrogate_loss(args: Any) -> bool:
    """The Trainer's arguments are TRL's of a trainer whose logged loss is a surrogate (:data:`SURROGATE_CONFIGS`, or
    a subclass). A callback is handed the arguments, never the trainer, and each of these trainers requires its own
    arguments class; trl is not imported.

    >>> class GRPOConfig:
    ...     __module__ = "trl.trainer.grpo_config"
    >>> class MyConfig(GRPOConfig):
    ...     __module__ = "mine"
    >>> surrogate_loss(MyConfig()), surrogate_loss(object())
    (True, False)
    """
    return any(c.__name__ in SURROGATE_CONFIGS and c.__module__.split(".")[0] == "trl" for c in type(args).__mro__)


def _prefix(metric: str) -> str:
    """The evaluation a Trainer metric belongs to: ``eval`` (one dataset) or ``eval_<dataset>``.

    >>> _prefix("eval_loss"), _prefix("eval_prose_runtime")
    ('eval', 'eval_prose')
    """
    return metric.rsplit("_", 1)[0]


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy / torch scalars and arrays
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


class AtlasTrainerCallback(TrainerCallback, ExportableState):
    """Run an atlas gate after the Trainer's evaluations, every ``gate.every_n_validations``.

    Args:
        canary: a :class:`~atlas_tracking.Canary`, a ``[n_windows, window]`` id array, or the path of a
            saved one (``.npz``/``.npy``).
        config: an :class:`~atlas_tracking.AtlasConfig`, a dict, or a YAML path.
        out_dir: where the baseline and gate records go (default ``<output_dir>/atlas``).
        sinks: extra sinks; the W&B and MLflow runs of ``report_to`` are added automatically.
        loss_key: the evaluation metric read as the gate's objective, as ``objective.metric`` names it (default
            ``eval_loss``, minimised; ``eval_reward``, maximised, under TRL's GRPOTrainer and RLOOTrainer; its
            direction is ``objective.direction``, else the metric's default). When a named metric is not in a
            gate's evaluation metrics, that gate fails with an error naming the metrics that are (training goes
            on); when the default is missing, the gate's loss is empty and a warning names them. A training
            loss is never read instead. With several evaluation datasets the Trainer evaluates them one after
            another at the same step: the gate runs once per step, after the evaluation whose metrics hold this
            key (name it ``eval_<dataset>_loss``).

    Resume: ``trainer.train(resume_from_checkpoint=...)`` loads the checkpoint's ``trainer_state.json``,
    and this callback reads its own entry there (``stateful_callbacks``), so the callback you pass
    continues the run, with its sinks and webhook (recommended; the Trainer's default). With
    ``restore_callback_states_from_checkpoint=True`` the Trainer replaces it by one re-created from the
    checkpoint (``type(cb)(**state["args"])``): the canary is read from the copy kept in the run
    directory (``canaries/``), the config from its saved values; ``sinks`` and a webhook URL given in the
    config (a secret, never written to ``trainer_state.json``) are not carried over.
    """

    def __init__(
        self,
        canary: Canary | str | Path,
        config: AtlasConfig | dict | str | Path | None = None,
        out_dir: str | Path | None = None,
        sinks: list[Any] | None = None,
        loss_key: str | None = None,
    ):
        try:
            self.canary = Canary.coerce(canary)
            self.config = AtlasConfig.coerce(config)
            self.losses = LossSource({"evaluation": EVAL_LOSS_KEYS}, loss_key, objective=self.config.objective,
                                     hint="Pass AtlasTrainerCallback(loss_key=...) to name the metric to read.",
                                     warn=_warn)
        except ValueError as exc:
            log.error("atlas: AtlasTrainerCallback cannot start: %s", exc)
            raise
        if self.config.gate.checkpoint_on_green:
            _warn("atlas: gate.checkpoint_on_green is a Lightning option; with the transformers Trainer, "
                  "checkpoints follow save_strategy (the option is not used here)")
        self.out_dir = None if out_dir is None else str(out_dir)
        self.extra_sinks = list(sinks or [])
        self.loss_key = loss_key
        self.atlas_state: dict[str, Any] | None = None
        """The checkpointed state the Trainer sets when it re-creates this callback from a checkpoint."""
        self.gates = ValidationGates(warn=_warn, source=self.losses)
        self._canary_file = str(canary) if isinstance(canary, (str, Path)) else None
        self._training = False
        self._rollouts = contextlib.ExitStack()
        """The policy's ``generate`` read while training (:func:`~atlas_tracking.integrations.generate_rollouts.
        trainer_rollouts`), given back at the end of training."""
        self._round_step = -1
        self._round: dict[str, float] | None = None
        """Metrics of the evaluations at ``_round_step`` while their gate is due and not yet run."""
        self._warned_datasets = False

    gate = property(lambda self: self.gates.gate)
    last_record = property(lambda self: self.gates.last_record)
    resume_counts = property(lambda self: self.gates.resume_counts)
    """What the last resume did: gates moved aside, caught up, re-delivered to trackers."""

    # --- set-up ------------------------------------------------------------------------------
    def _build(self, args: TrainingArguments, state: TrainerState, model: Any, trackers: bool) -> None:
        out_dir = Path(self.out_dir) if self.out_dir else Path(args.output_dir) / "atlas"
        sinks = tracker_sinks(args.report_to) if trackers and state.is_world_process_zero else []
        try:
            gate = AtlasGate(model, self.canary, self.config, out_dir=out_dir,
                             sinks=[*sinks, *self.extra_sinks, LoggingSink(gate_lines())])
        except ValueError as exc:  # no routed layer, a canary that does not fit: before the first step
            log.error("atlas: AtlasTrainerCallback cannot start: %s", exc)
            raise
        self.gates.attach(gate)

    def _checkpointed(self, state: TrainerState) -> dict[str, Any] | None:
        """The callback state of the checkpoint training resumes from (None for a fresh start)."""
        saved, self.atlas_state = self.atlas_state, None
        if state.global_step == 0:  # a fresh start: the Trainer's state holds this object's own state
            return None
        if saved is None:  # restore_callback_states_from_checkpoint=False: the loaded trainer_state.json
            entry = (state.stateful_callbacks or {}).get(type(self).__name__)
            if isinstance(entry, list):  # several callbacks of this class: the first one's
                entry = entry[0] if entry else None
            saved = ((entry or {}).get("attributes") or {}).get("atlas_state")
        if saved and saved.get("webhook_url_given") and not self.config.alerts.webhook_url:
            _warn("atlas: the checkpointed run sent alerts to a webhook URL given in its config; the URL is a "
                  f"secret and is not kept in checkpoints: set {self.config.alerts.webhook_url_env} to keep it")
        return saved if saved and "gate" in saved else None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Any = None, **kwargs: Any) -> None:
        restored = self._checkpointed(state)
        self._objective(args)
        if args.eval_strategy == "no":
            _warn("atlas: TrainingArguments.eval_strategy is 'no': the Trainer never evaluates, so no gate runs "
                  "after the step-0 baseline. Set eval_strategy='steps' and eval_steps=N to gate every N steps.")
        self._build(args, state, model, trackers=True)
        if self.gates.gate.telemetry is not None:  # intervals at the Trainer's logging cadence unless configured
            self.gates.gate.telemetry.follow(logging_cadence(args, state))
        self.gates.load_state_dict(restored)
        self._round_step, self._round = -1, None
        self.gates.start(int(state.global_step))
        if surrogate_loss(args):  # rollouts from the policy's own generate: each one handed to the gate
            self._rollouts.enter_context(trainer_rollouts(args, state, model, self.gates.gate, _warn))
        self._keep_canary()
        # The Trainer updates every stateful callback's entry when it saves and fails on a missing one
        # (a run resumed from a checkpoint written without this callback).
        state.stateful_callbacks.setdefault(type(self).__name__, self.state())
        self._training = True

    def _objective(self, args: TrainingArguments) -> None:
        """The default objective of this Trainer: the mean reward under a surrogate loss, else the evaluation loss."""
        self.losses.keys["evaluation"] = REWARD_KEYS if surrogate_loss(args) else EVAL_LOSS_KEYS

    def _keep_canary(self) -> None:
        gate = self.gates.gate
        if gate is None or not _is_rank_zero():
            return
        path = gate.run_dir.canary_file(self.canary.fingerprint)
        try:
            if not path.exists():
                self.canary.save(path)
        except OSError as exc:  # a full disk: the checkpoint keeps no canary file now; training goes on
            _warn(f"atlas: the canary could not be kept at {path} ({exc}); a resume needs it given again")
            return
        self._canary_file = str(path)

    # --- gates -------------------------------------------------------------------------------
    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    metrics: dict[str, float] | None = None, model: Any = None, **kwargs: Any) -> None:
        step = int(state.global_step)
        metrics = dict(metrics or {})
        self._objective(args)
        if not self._training:  # trainer.evaluate() outside training: not part of the history
            if self._last_of_round(metrics):
                if self.gates.gate is None:
                    self._build(args, state, model, trackers=False)
                self.gates.evaluate(step, self.losses.read(metrics, "evaluation"), "evaluate")
            elif not self._warned_datasets and all(_prefix(n) == "eval" for n in self.losses.names("evaluation")):
                self._warned_datasets = True
                _warn("atlas: trainer.evaluate() ran on several evaluation datasets and the gate's loss "
                      f"({', '.join(self.losses.names('evaluation'))}) names none of them: no evaluation gate is written. "
                      "Pass AtlasTrainerCallback(loss_key='eval_<dataset>_loss').")
            return
        if step != self._round_step:
            # The first evaluation at this step; with several evaluation datasets one follows per dataset.
            # eval_on_start right after the step-0 baseline and a step already in the history do not count.
            self._flush()
            self._round_step = step
            due = not self.gates.gated(step) and self.gates.due()
            self._round = {} if due else None
        if self._round is None:
            return
        self._round.update(metrics)
        if self._last_of_round(metrics):
            self._flush()

    def _last_of_round(self, metrics: dict[str, float]) -> bool:
        """This evaluation carries the gate's loss, or no other evaluation follows at this step (one dataset:
        the Trainer's ``eval_runtime``). With several datasets the gate waits for the one its loss names."""
        if any(name in metrics for name in self.losses.names("evaluation")):
            return True
        prefixes = {_prefix(key) for key in metrics if key.endswith("_runtime")}
        return not prefixes or prefixes == {"eval"}

    def _flush(self) -> None:
        """Run the gate an evaluation round made due (at the latest before the next step or the end)."""
        if self._round is None:
            return
        metrics, self._round = self._round, None
        self.gates.read_run(self._round_step, metrics, "evaluation")

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._flush()

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        """The optimizer-step boundary: a gate an evaluation made due, else the early gate the alarm asked for."""
        self._flush()
        self.gates.early(int(state.global_step))

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """After the optimizer step: the training-batch load interval closes when it is due."""
        if self._training:
            self.gates.step(int(state.global_step))

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._flush()
        self.gates.early(int(state.global_step))
        self._training = False
        self._rollouts.close()
        self.gates.finish()

    # --- checkpointed state (ExportableState) ----------------------------------------------
    def state(self) -> dict[str, Any]:
        """JSON-safe: ``args`` re-create this callback (canary file, config values, record directory),
        ``attributes`` hold the gate state (policy, alerts, the history's lineage, cadence)."""
        config = self.config.to_dict()
        config["alerts"]["webhook_url"] = ""  # a secret: never written to trainer_state.json
        gate = self.gates.gate
        args = {"canary": self._canary_file, "config": config, "out_dir": self.out_dir, "loss_key": self.loss_key}
        try:
            atlas_state = json.loads(json.dumps(self.gates.state_dict(), default=_plain))
        except (TypeError, ValueError) as exc:  # a checkpoint must never fail because of monitoring
            if gate is not None:
                gate.record_failure(int(gate.lineage[-1][0]) if gate.lineage else 0, exc)
            _warn(f"atlas: the gate state cannot be written to trainer_state.json ({exc}); a resume from this "
                  "checkpoint starts a new atlas record")
            atlas_state = None
        if atlas_state is not None:
            atlas_state["webhook_url_given"] = bool(self.config.alerts.webhook_url)
        return {"args": args, "attributes": {"atlas_state": atlas_state}}
