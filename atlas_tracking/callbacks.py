"""What every training framework's callback does around :class:`~atlas_tracking.gate.AtlasGate`.

A callback (Lightning's ``AtlasCallback``, the transformers ``AtlasTrainerCallback``) maps its
framework's hooks to the calls of :class:`ValidationGates`: ``start`` when training starts (resume
from the checkpointed state, or claim the run directory and measure the step-0 baseline), ``due``
after every validation (the ``gate.every_n_validations`` cadence), ``run`` for a gate that never
stops training (a failure goes to ``atlas/errors.jsonl``, a warning and an ERROR alert), ``evaluate`` for a gate
outside the training history, and ``state_dict`` / ``load_state_dict`` for the checkpoint.
:class:`LossSource` reads the gate's objective from the metrics the framework logged, by name, and says
the direction it improves in (``objective`` in the config): when the integration's default metric is
missing the loss stays empty and one warning names the metrics that are there (a training loss is never
read in its place); when the operator named the metric (``loss_key=`` or ``objective.metric``), a gate
whose evaluation did not log it fails, naming the metrics it did log (:meth:`ValidationGates.read_run`).

Example (a plain loop standing in for a framework):
    >>> import numpy as np, torch, tempfile, warnings
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> from atlas_tracking import Canary
    >>> _ = torch.manual_seed(0)
    >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ...     head_dim=8, num_experts=8, num_experts_per_tok=2))
    >>> canary = Canary.from_token_ids(np.arange(2000) % 64, window=32, n_windows=8, seed=0)
    >>> gates = ValidationGates(AtlasGate(model, canary, {"receipts": {"progress": False}}, out_dir=tempfile.mkdtemp()))
    >>> losses = LossSource({"validation": ("val_loss",)}, hint="pass loss_key=... to name it")
    >>> gates.start(step=0)["status"]
    'BASELINE'
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     loss = losses.read({"train_loss": 3.2}, "validation")
    >>> loss, str(caught[0].message).split(";")[0]
    (None, 'atlas: no validation loss for the gate: any of val_loss is not among the logged metrics [train_loss]')
    >>> gates.due() and gates.run(10, losses.read({"val_loss": 3.9}, "validation"))["loss"]
    3.9
    >>> named = ValidationGates(gates.gate, source=LossSource({"validation": ("val_loss",)}, loss_key="val_acc"))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     named.read_run(20, {"val_loss": 3.8}, "validation")
    >>> str(caught[0].message).split(" [")[0]
    "atlas gate at step 20 failed and was skipped: MissingObjectiveError: the objective 'val_acc' is not among the metrics the validation logged"
    >>> named.read_run(30, {"val_acc": 0.6}, "validation")["objective_direction"]
    'maximize'
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from atlas_tracking.gate import AtlasGate
from atlas_tracking.schema.config import ConfigError, ObjectiveConfig

log = logging.getLogger("atlas_tracking")

Warn = Callable[[str], None]


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=3)


class MissingObjectiveError(ValueError):
    """The metric named as the gate's objective is not among the metrics the gate's evaluation logged."""


class LossSource:
    """The gate's objective, read by name from logged metrics, and the direction it improves in.

    Args:
        keys: per stage (``"validation"``, ``"test"``, ...), the integration's metric names tried in order, the
            training stage's first.
        loss_key: the metric the operator names (a callback's ``loss_key=``); it replaces ``keys`` in every stage.
        hint: how to name the metric, said in the warning (e.g. ``"Pass AtlasCallback(loss_key=...)"``).
        warn: how a warning is raised (a framework's rank-zero warning; default ``warnings.warn``).
        objective: the configuration's ``objective``: its ``metric`` names the metric as ``loss_key`` does (the two
            naming different metrics is a :class:`~atlas_tracking.schema.config.ConfigError`), its ``direction``
            says how the objective improves.
    """

    def __init__(self, keys: Mapping[str, tuple[str, ...]], loss_key: str | None = None, hint: str = "",
                 warn: Warn = _warn, objective: ObjectiveConfig | None = None):
        self.objective = objective or ObjectiveConfig()
        if loss_key and self.objective.metric and loss_key != self.objective.metric:
            raise ConfigError(f"loss_key {loss_key!r} and 'objective.metric' {self.objective.metric!r} name different "
                              "metrics: name the gate's objective once")
        self.keys, self.loss_key, self.hint, self.warn = dict(keys), loss_key or self.objective.metric, hint, warn
        self._warned: set[str] = set()
        self.found: str | None = None
        """The metric the last :meth:`read` took the loss from (None: none was logged)."""

    @property
    def direction(self) -> str:
        """How the objective improves: ``objective.direction``, else the default of the named metric, else that of
        the training stage's first name (:func:`~atlas_tracking.schema.config.default_direction`).

        >>> LossSource({"evaluation": ("eval_reward",)}).direction, LossSource({"validation": ("val_loss",)}).direction
        ('maximize', 'minimize')
        """
        return self.objective.direction_for(self.loss_key or next(iter(self.keys.values()))[0])

    def names(self, stage: str) -> tuple[str, ...]:
        return (self.loss_key,) if self.loss_key else self.keys[stage]

    def read(self, metrics: Mapping[str, Any], stage: str, strict: bool = False) -> float | None:
        """The objective's value: the first of :meth:`names` in ``metrics``. When none is there, with ``strict`` and a
        named metric, :class:`MissingObjectiveError` naming the metrics that are; otherwise None and one warning per
        stage."""
        names = self.names(stage)
        self.found = None
        for name in names:
            value = metrics.get(name)
            if value is not None:
                self.found = name
                return float(value)
        logged = ", ".join(sorted(metrics)) or "none"
        if strict and self.loss_key:
            raise MissingObjectiveError(f"the objective '{self.loss_key}' is not among the metrics the {stage} logged "
                                        f"[{logged}]; name a logged metric (objective.metric or loss_key)")
        if stage not in self._warned:
            self._warned.add(stage)
            wanted = f"'{self.loss_key}'" if self.loss_key else "any of " + ", ".join(names)
            self.warn(
                f"atlas: no {stage} loss for the gate: {wanted} is not among the logged metrics "
                f"[{logged}]; the gate's loss is left empty (no loss trend). {self.hint}"
                .rstrip())
        return None


class ValidationGates:
    """An :class:`AtlasGate` driven by a training framework's callback: cadence, failures, state, resume.

    Args:
        gate: the gate (built by the callback once the model is known; see :meth:`attach`).
        warn: how warnings are raised (a framework's rank-zero warning; default ``warnings.warn``).
        source: where the gates read their objective and its direction (None: the gate's ``objective`` config).
    """

    def __init__(self, gate: AtlasGate | None = None, warn: Warn = _warn, source: LossSource | None = None):
        self.gate = gate
        self.warn = warn
        self.source = source
        self.validations = 0
        """Validations seen in training (the cadence counts them; checkpointed)."""
        self.green: list[str] = []
        """Geometry-aware checkpoints kept (Lightning's ``gate.checkpoint_on_green``)."""
        self.restored: dict[str, Any] | None = None
        """A checkpointed state waiting for training to start (or for an evaluation to read against)."""
        self.last_record: dict[str, Any] | None = None
        self.resume_counts: dict[str, int] | None = None
        """What the last resume did: gates moved aside, caught up, re-delivered to trackers."""

    def attach(self, gate: AtlasGate) -> None:
        """Use ``gate`` from now on (a new gate starts counting validations afresh unless a state is restored)."""
        self.gate = gate
        self.validations = 0
        self.green = []

    # --- training ---------------------------------------------------------------------------
    def start(self, step: int, log_step: int | None = None) -> dict[str, Any] | None:
        """Training starts at ``step``: resume from a restored state, or claim the run directory and run
        the step-0 baseline (``gate.baseline_at_start``). Returns the baseline record, if one ran. A run directory
        that cannot be written (a full disk) is a failed gate, never a stopped fit: the next gate claims it again."""
        assert self.gate is not None
        try:
            if self.restored is not None and "gate" in self.restored:
                state, self.restored = self.restored, None
                self.validations = int(state.get("validations", 0))
                self.green = list(state.get("green_checkpoints", []))
                self.resume_counts = self.gate.resume(int(step), state["gate"])
                return None
            self.restored = None
            self.gate.claim()
        except OSError as exc:  # monitoring must never stop training
            self.warn(f"atlas: the run directory could not be written at the start of training: {exc}")
            self._record_failure(step, exc, log_step)
            return None
        if self.gate.config.gate.baseline_at_start and self.gate.baseline_path is None:
            return self.run(step, None, log_step=log_step, trigger="start")
        return None

    def gated(self, step: int) -> bool:
        """A gate at ``step`` (or later) is already in this run's history."""
        return self.gate is not None and bool(self.gate.lineage) and int(self.gate.lineage[-1][0]) >= int(step)

    def due(self) -> bool:
        """Count one validation; True when it is one the cadence (``gate.every_n_validations``) gates."""
        assert self.gate is not None
        self.validations += 1
        return self.validations % self.gate.config.gate.every_n_validations == 0

    def run(self, step: int, loss: float | None, log_step: int | None = None, trigger: str = "validation",
            loss_key: str | None = None) -> dict[str, Any] | None:
        """One gate; a failure never stops training (``atlas/errors.jsonl``, a warning and an ERROR alert through
        every sink, :meth:`AtlasGate.record_failure`; returns None)."""
        return self._guarded(step, log_step, trigger, lambda: self.gate.run(
            step, loss=loss, log_step=log_step, trigger=trigger, loss_key=loss_key, direction=self._direction()))

    def read_run(self, step: int, metrics: Mapping[str, Any], stage: str,
                 log_step: int | None = None) -> dict[str, Any] | None:
        """A gate whose objective is read from the evaluation's logged ``metrics`` (:meth:`LossSource.read`, strict):
        a named metric they lack fails the gate, naming the metrics they hold, as any failed gate does (:meth:`run`)."""
        assert self.source is not None
        source = self.source

        def gate() -> dict[str, Any]:
            loss = source.read(metrics, stage, strict=True)
            return self.gate.run(step, loss=loss, log_step=log_step, loss_key=source.found, direction=source.direction)

        return self._guarded(step, log_step, "validation", gate)

    def _direction(self) -> str | None:
        return self.source.direction if self.source is not None else None

    def _guarded(self, step: int, log_step: int | None, trigger: str,
                 gate: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """Run ``gate``; a failure is recorded and warned about, never raised."""
        assert self.gate is not None
        try:
            record = gate()
        except Exception as exc:  # monitoring must never stop training
            self.warn(f"atlas gate at step {step} failed and was skipped: {type(exc).__name__}: {exc}")
            if trigger == "telemetry" and self.gate.telemetry is not None:
                self.gate.telemetry.requested = None  # asked once: its failure is the alarm now, not a retry per step
            self._record_failure(step, exc, log_step)
            return None
        if record.get("status") == "FAILED":  # its record could not be written: held, and recorded as failed
            self.warn(f"atlas gate at step {step} failed: {record['error']} ({record['waiting']} record(s) wait in "
                      "memory for the disk)")
            return None
        self.last_record = record
        return record

    def _record_failure(self, step: int, exc: BaseException, log_step: int | None) -> None:
        assert self.gate is not None
        try:
            self.gate.record_failure(step, exc, log_step=log_step)
        except Exception as lost:  # not even the failure could be recorded: still train on
            log.error("atlas: the failed gate at step %s could not be recorded: %s: %s", step,
                      type(lost).__name__, lost)

    # --- between gates ---------------------------------------------------------------------------
    def step(self, step: int, log_step: int | None = None) -> None:
        """An optimizer step has ended (every rank): the training-batch load interval closes when it is due. A
        failure is a warning (that interval's routes are lost), never a stopped run."""
        assert self.gate is not None
        try:
            self.gate.step(step, log_step=log_step, early=False)
        except Exception as exc:  # monitoring must never stop training
            self.warn(f"atlas: the training-batch load at step {step} could not be closed: {type(exc).__name__}: {exc}")

    def early_due(self) -> bool:
        """The training-batch routing alarm asked for a gate that no gate has answered yet."""
        telemetry = self.gate.telemetry if self.gate is not None else None
        return telemetry is not None and telemetry.requested is not None

    def early(self, step: int, log_step: int | None = None) -> dict[str, Any] | None:
        """The early gate the alarm asked for, at this optimizer-step boundary (no validation ran: no loss); none
        when a gate of this step is already in the history (it answered the alarm)."""
        if not self.early_due():
            return None
        if self.gated(step):
            self.gate.telemetry.requested = None
            return None
        return self.run(step, None, log_step=log_step, trigger="telemetry")

    def evaluate(self, step: int, loss: float | None, kind: str) -> dict[str, Any] | None:
        """A gate outside the training history (``atlas/evaluations.jsonl``), read against the run's
        state: the restored one when an evaluation starts from a checkpoint."""
        assert self.gate is not None
        if self.restored is not None and "gate" in self.restored:
            self.gate.load_state_dict(self.restored["gate"])
        try:
            self.last_record = self.gate.evaluate(step, loss, kind=kind, direction=self._direction(),
                                                  loss_key=self.source.found if self.source is not None else None)
        except Exception as exc:
            self.warn(f"atlas {kind} gate at step {step} failed: {type(exc).__name__}: {exc}")
            return None
        return self.last_record

    def finish(self) -> None:
        """The end of training: the trackers waited for, the backlog written; a failure is a warning."""
        if self.gate is not None:
            try:
                self.gate.finish()
            except Exception as exc:  # monitoring must never stop training, nor its end
                self.warn(f"atlas: the end of training could not be recorded: {type(exc).__name__}: {exc}")

    # --- checkpointed state -----------------------------------------------------------------
    def state_dict(self, **extra: Any) -> dict[str, Any]:
        """The callback's checkpointed state: the gate's, the validation count, kept checkpoints, ``extra``."""
        if self.gate is None:
            return self.restored or {}
        return {"gate": self.gate.state_dict(), "validations": self.validations,
                "green_checkpoints": list(self.green), **extra}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Keep a checkpointed state until training (``start``) or an evaluation reads it."""
        if state:
            self.restored = state
