"""Rollout agreement in a training loop: each recorded step measured, written, summarised and read by an alarm.

:class:`Rollouts` is what :meth:`~atlas_tracking.gate.AtlasGate.rollout` runs (docs/rollout.md#in-a-training-loop).
A reinforcement-learning loop (verl-, slime-, NeMo-RL- or OpenRLHF-style) hands it, every training step, the
tokens it trains on and the routed experts its rollout engine returned; every ``rollout.every_n_steps`` steps it
runs the trainer's forward on them (:func:`~atlas_tracking.engine.rollout.read_agreement`), sums the comparison
over every process (collective), and rank zero appends the line to ``atlas/rollout.jsonl`` first, then the alerts
and the trackers' bounded keys (``atlas/rollout/...``) go through the same background delivery as the gates.
:class:`~atlas_tracking.decisions.rollout_alarm.RolloutAlarm` reads each line on every process alike.

Example (a plain loop; the rollout engine is the model itself, so the two agree):
    >>> import torch, tempfile, json
    >>> from pathlib import Path
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> from atlas_tracking.adapters import find_routed_layers
    >>> from atlas_tracking.engine.rollout import trainer_routes
    >>> from atlas_tracking.schema.config import AtlasConfig
    >>> from atlas_tracking.sinks.delivery import Delivery, Writer
    >>> from atlas_tracking.sinks.held import Held
    >>> from atlas_tracking.sinks.jsonl import JsonlSink
    >>> _ = torch.manual_seed(0)
    >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ...     head_dim=8, num_experts=8, num_experts_per_tok=2)).eval()
    >>> rollouts = Rollouts(find_routed_layers(model), AtlasConfig())
    >>> out = tempfile.mkdtemp()
    >>> writer = Writer(Path(out), "run", "main", Delivery(None, []), Held(JsonlSink(Path(out) / "gates.jsonl")))
    >>> ids = torch.randint(0, 64, (2, 16))
    >>> line = rollouts.record(model, 7, writer, ids, trainer_routes(model, ids))
    >>> line["step"], [row["mismatched"] for row in line["layers"]], line["alerts"]
    (7, [0, 0], [])
    >>> json.loads(open(out + "/rollout.jsonl").read())["tokens"]
    32
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import nn

from atlas_tracking.adapters.base import RoutedLayer
from atlas_tracking.artifacts.rollout_summary import rollout_metrics
from atlas_tracking.decisions.rollout_alarm import RolloutAlarm
from atlas_tracking.engine.rollout import Forward, read_agreement, summarize
from atlas_tracking.schema.artifacts import ROLLOUT
from atlas_tracking.schema.config import AtlasConfig
from atlas_tracking.schema.rollout import ROLLOUT_SCHEMA_VERSION
from atlas_tracking.sinks.delivery import Writer

log = logging.getLogger("atlas_tracking")

class Rollouts:
    """Rollout agreement of one model, step by step; see the module docstring."""

    def __init__(self, layers: list[RoutedLayer], config: AtlasConfig):
        self.cfg = config.rollout
        self.layers = layers
        self.alarm = RolloutAlarm(self.cfg, config.alerts.wait_duration_s)
        self._warned: set[str] = set()
        self.segments: list[list[Any]] = []
        """``[[branch, first step], ...]``: the training segments whose recorded steps make the record's history."""

    def due(self, step: int) -> bool:
        """A rollout handed over at ``step`` is measured (``rollout.every_n_steps``)."""
        return int(step) % self.cfg.every_n_steps == 0

    def state_dict(self) -> dict[str, Any]:
        return {"alarm": self.alarm.state_dict(), "segments": [list(s) for s in self.segments]}

    def resume(self, step: int, state: dict[str, Any] | None, branch: str) -> None:
        """Continue the restored state's history at ``step`` on ``branch`` (its alarm state included)."""
        state = state or {}
        self.alarm.load_state_dict(state.get("alarm", {}))
        self.segments = [list(s) for s in state.get("segments", [])] + [[branch, int(step) + 1]]

    def record(self, model: nn.Module, step: int, writer: Writer | None, input_ids: Any, routed_experts: Any,
               attention_mask: Any = None, *, rollout_logprobs: Any = None, trainer_logprobs: Any = None,
               replayed: bool = False, forward: Forward | None = None, log_step: int | None = None) -> dict[str, Any]:
        """Measure one step's rollout (collective: every process with its own batch), read it with the alarm and,
        on rank zero (``writer``), write it first and deliver it; returns the line."""
        readout = read_agreement(model, input_ids, routed_experts, attention_mask, rollout_logprobs=rollout_logprobs,
                                 trainer_logprobs=trainer_logprobs, forward=forward, layers=self.layers)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        line: dict[str, Any] = {
            "schema_version": ROLLOUT_SCHEMA_VERSION, "step": int(step),
            "processes": torch.distributed.get_world_size() if distributed else 1,
            **summarize(readout, replayed)}
        if writer is not None:
            line.update(run_id=writer.run_id, branch=writer.branch)
            if not self.segments:
                self.segments = [[writer.branch, int(step)]]
        reading = self.alarm.read(line)
        line.update(breach=reading.breach, rising=reading.rising, alerts=reading.alerts, alarm=reading.standing)
        if writer is not None:
            self._write(line, writer, int(step) if log_step is None else int(log_step))
        return line

    def guarded(self, model: nn.Module, step: int, writer: Writer | None, *args: Any, **options: Any
                ) -> dict[str, Any] | None:
        """:meth:`record` that never stops training: a failure (bad input included: it names what differs) is one
        warning per distinct message and an error in the log; returns None then."""
        try:
            return self.record(model, step, writer, *args, **options)
        except Exception as exc:  # monitoring must never stop training
            message = f"atlas: the rollout agreement of step {step} failed: {type(exc).__name__}: {exc}"
            log.error(message)
            if message.split(": ", 2)[-1] not in self._warned:
                self._warned.add(message.split(": ", 2)[-1])
                warnings.warn(message, UserWarning, stacklevel=3)
            return None

    @staticmethod
    def _write(line: dict[str, Any], writer: Writer, log_step: int) -> None:
        """``rollout.jsonl`` first, then the alerts (``alerts.jsonl``, every sink) and the trackers; a line the disk
        refuses waits in memory and is written in turn when it has room (:meth:`Writer.append`), and never stops
        training."""
        writer.append(ROLLOUT, line, f"the rollout agreement of step {line['step']}")
        for event in line["alerts"]:
            writer.delivery.alert(event)
        writer.delivery.rollout(line, rollout_metrics(line), log_step)
