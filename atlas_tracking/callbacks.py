"""What every training framework's callback does around :class:`~atlas_tracking.gate.AtlasGate`.

A callback (Lightning's ``AtlasCallback``, the transformers ``AtlasTrainerCallback``) maps its
framework's hooks to the calls of :class:`ValidationGates`: ``start`` when training starts (resume
from the checkpointed state, or claim the run directory and measure the step-0 baseline), ``due``
after every validation (the ``gate.every_n_validations`` cadence), ``run`` for a gate that never
stops training (a failure goes to ``atlas/errors.jsonl``, a warning and an ERROR alert), ``evaluate`` for a gate
outside the training history, and ``state_dict`` / ``load_state_dict`` for the checkpoint.
:class:`LossSource` reads the gate's loss from the metrics the framework logged, by name: when the
metric is missing the loss stays empty and one warning names the metrics that are there (a
training loss is never read in its place).

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
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from atlas_tracking.gate import AtlasGate

log = logging.getLogger("atlas_tracking")

Warn = Callable[[str], None]


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=3)


class LossSource:
    """The gate's loss, read by name from logged metrics; one warning per stage when it is missing.

    Args:
        keys: per stage (``"validation"``, ``"test"``, ...), the metric names tried in order.
        loss_key: a metric name that replaces ``keys`` in every stage.
        hint: how to name the metric, said in the warning (e.g. ``"Pass AtlasCallback(loss_key=...)"``).
        warn: how a warning is raised (a framework's rank-zero warning; default ``warnings.warn``).
    """

    def __init__(self, keys: Mapping[str, tuple[str, ...]], loss_key: str | None = None, hint: str = "",
                 warn: Warn = _warn):
        self.keys, self.loss_key, self.hint, self.warn = dict(keys), loss_key, hint, warn
        self._warned: set[str] = set()
        self.found: str | None = None
        """The metric the last :meth:`read` took the loss from (None: none was logged)."""

    def names(self, stage: str) -> tuple[str, ...]:
        return (self.loss_key,) if self.loss_key else self.keys[stage]

    def read(self, metrics: Mapping[str, Any], stage: str) -> float | None:
        names = self.names(stage)
        self.found = None
        for name in names:
            value = metrics.get(name)
            if value is not None:
                self.found = name
                return float(value)
        if stage not in self._warned:
            self._warned.add(stage)
            wanted = f"'{self.loss_key}'" if self.loss_key else "any of " + ", ".join(names)
            self.warn(
                f"atlas: no {stage} loss for the gate: {wanted} is not among the logged metrics "
                f"[{', '.join(sorted(metrics)) or 'none'}]; the gate's loss is left empty (no loss trend). {self.hint}"
                .rstrip())
        return None


class ValidationGates:
    """An :class:`AtlasGate` driven by a training framework's callback: cadence, failures, state, resume.

    Args:
        gate: the gate (built by the callback once the model is known; see :meth:`attach`).
        warn: how warnings are raised (a framework's rank-zero warning; default ``warnings.warn``).
    """

    def __init__(self, gate: AtlasGate | None = None, warn: Warn = _warn):
        self.gate = gate
        self.warn = warn
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
        the step-0 baseline (``gate.baseline_at_start``). Returns the baseline record, if one ran."""
        assert self.gate is not None
        if self.restored is not None and "gate" in self.restored:
            state, self.restored = self.restored, None
            self.validations = int(state.get("validations", 0))
            self.green = list(state.get("green_checkpoints", []))
            self.resume_counts = self.gate.resume(int(step), state["gate"])
            return None
        self.restored = None
        self.gate.claim()
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
        assert self.gate is not None
        try:
            record = self.gate.run(step, loss=loss, log_step=log_step, trigger=trigger, loss_key=loss_key)
        except Exception as exc:  # monitoring must never stop training
            self.warn(f"atlas gate at step {step} failed and was skipped: {type(exc).__name__}: {exc}")
            if trigger == "telemetry" and self.gate.telemetry is not None:
                self.gate.telemetry.requested = None  # asked once: its failure is the alarm now, not a retry per step
            try:
                self.gate.record_failure(step, exc, log_step=log_step)
            except Exception as lost:  # not even the failure could be recorded (a full disk): still train on
                log.error("atlas: the failed gate at step %s could not be recorded: %s: %s", step,
                          type(lost).__name__, lost)
            return None
        self.last_record = record
        return record

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
            self.last_record = self.gate.evaluate(step, loss, kind=kind)
        except Exception as exc:
            self.warn(f"atlas {kind} gate at step {step} failed: {type(exc).__name__}: {exc}")
            return None
        return self.last_record

    def finish(self) -> None:
        if self.gate is not None:
            self.gate.finish()

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
