"""Between gates: every training step's routing, counted right, written, summarised, and read by an alarm.

:class:`Telemetry` is what an :class:`~atlas_tracking.gate.AtlasGate` runs between its gates
(docs/telemetry.md). Its :class:`~atlas_tracking.engine.route_counts.RouteCounter` counts, on the model's
device, the routes the model's router chooses in every training forward. Every ``telemetry.every_n_steps``
optimizer steps, and at every gate, an interval closes (collectively: one reduction over every process, one
copy to the host): rank zero appends it to ``atlas/load.jsonl`` first, then the trackers receive its bounded
summary (and every ``telemetry.picture_every`` intervals the layers x experts picture and table) through the
same background delivery as the gates. :class:`~atlas_tracking.decisions.load_alarm.LoadAlarm` reads each
interval on every process alike; when it raises the alarm, the alert goes through every channel and, with
``telemetry.early_gate``, a gate is asked for at the next optimizer-step boundary (:attr:`Telemetry.requested`).
The gate, not the alarm, moves the policy's stage.

Example (a plain loop; ``AtlasGate.step`` calls this after every optimizer step):
    >>> import numpy as np, torch, tempfile, json
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> from atlas_tracking import Canary
    >>> from atlas_tracking.gate import AtlasGate
    >>> _ = torch.manual_seed(0)
    >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ...     head_dim=8, num_experts=8, num_experts_per_tok=2))
    >>> canary = Canary.from_token_ids(np.arange(2000) % 64, window=32, n_windows=8, seed=0)
    >>> out = tempfile.mkdtemp()
    >>> gate = AtlasGate(model, canary, {"receipts": {"progress": False}, "telemetry": {"every_n_steps": 2}},
    ...                  out_dir=out)
    >>> gate.run(step=0)["status"]
    'BASELINE'
    >>> for step in (1, 2):
    ...     _ = model.train()(torch.randint(0, 64, (4, 16)))       # forward (and backward, optimizer step)
    ...     gate.step(step)
    >>> line = json.loads(open(out + "/load.jsonl").read())
    >>> line["first_step"], line["step"], line["tokens"], [sum(row["load"]) for row in line["layers"]]
    (1, 2, 128, [256, 256])
"""

from __future__ import annotations

from typing import Any

from atlas_tracking.adapters.base import RoutedLayer
from atlas_tracking.artifacts.load_summary import load_metrics
from atlas_tracking.decisions.load_alarm import LoadAlarm, Reading
from atlas_tracking.engine.route_counts import Interval, RouteCounter
from atlas_tracking.schema.artifacts import LOAD
from atlas_tracking.schema.config import AtlasConfig
from atlas_tracking.schema.load import LOAD_SCHEMA_VERSION
from atlas_tracking.sinks.delivery import Writer

PLAIN_LOOP_EVERY = 50
"""Optimizer steps per interval where neither ``telemetry.every_n_steps`` nor a framework's logging cadence says."""


class Telemetry:
    """Training-batch routing of one model between its gates; see the module docstring."""

    def __init__(self, layers: list[RoutedLayer], config: AtlasConfig):
        self.cfg = config.telemetry
        self.counter = RouteCounter(layers).attach()
        self.alarm = LoadAlarm(self.cfg, config.policy, config.alerts.wait_duration_s)
        self.every = self.cfg.every_n_steps or PLAIN_LOOP_EVERY
        self.last_step: int | None = None
        """The step the last interval closed at (the run's start or resume step before the first)."""
        self.seen_step: int | None = None
        """The last optimizer step :meth:`step` was told of."""
        self.segments: list[list[Any]] = []
        """``[[branch, first step], ...]``: the training segments whose intervals make the record's history."""
        self.intervals = 0
        """Intervals written in this run (the picture goes with every ``picture_every``-th)."""
        self.requested: dict[str, Any] | None = None
        """An early gate the alarm asked for: ``step`` (the interval that raised it) and ``text``."""
        self._uncounted: list[int] | None = None

    def follow(self, every: int | None) -> None:
        """Take a framework's logging cadence (optimizer steps) unless ``telemetry.every_n_steps`` is set."""
        if self.cfg.every_n_steps is None and every:
            self.every = max(1, int(every))

    # --- the run's history ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"segments": [list(s) for s in self.segments], "last_step": self.last_step,
                "intervals": self.intervals, "requested": self.requested, "alarm": self.alarm.state_dict()}

    def resume(self, step: int, state: dict[str, Any] | None, branch: str) -> None:
        """Continue the restored state's history at ``step`` on ``branch``: the counts since its last interval
        are gone with the processes that made them, which the next line says (``uncounted``). An early gate the
        restored state still asked for is not run: the resume's first gate is a new baseline, which answers it."""
        state = state or {}
        self.alarm.load_state_dict(state.get("alarm", {}))
        self.intervals = int(state.get("intervals", 0))
        self.requested = None
        last = state.get("last_step")
        self.segments = [list(s) for s in state.get("segments", [])] + [[branch, int(step) + 1]]
        self._uncounted = [int(last) + 1, int(step)] if last is not None and int(last) < int(step) else None
        self.last_step = self.seen_step = int(step)
        self.counter.reset()

    # --- intervals -----------------------------------------------------------------------------
    def step(self, step: int, pretraining: bool, writer: Writer | None, log_step: int | None = None) -> bool:
        """An optimizer step has ended (every process, in step); closes the interval when it is due. True when an
        early gate is asked for."""
        self.seen_step = int(step)
        if self.last_step is None:
            self.last_step = int(step) - 1
        if step % self.every == 0:
            self.close(step, pretraining, writer, log_step)
        return self.requested is not None

    def close(self, step: int, pretraining: bool, writer: Writer | None, log_step: int | None = None) -> Reading | None:
        """Close the interval up to ``step`` (collective; nothing when no step ran since the last one)."""
        step = int(step)
        if self.last_step is None or step <= self.last_step:
            self.last_step = step if self.last_step is None else self.last_step
            return None
        interval = self.counter.collect()
        first, self.last_step = self.last_step + 1, step
        if not any(row["calls"] for row in interval.layers):
            return None  # no training forward since the last interval (a gate right after one)
        line = self._line(first, step, interval, writer)
        reading = self.alarm.read(line, pretraining)
        line.update(phase="pretraining" if pretraining else "post_training", reference_step=reading.reference_step,
                    breach=reading.breach, alerts=reading.alerts, alarm=reading.standing,
                    alarm_layers=reading.alarm_layers, early_gate=reading.early_gate)
        if reading.early_gate:
            self.requested = {"step": step, "text": reading.alerts[0]["text"]}
        picture = self.intervals % self.cfg.picture_every == 0
        self.intervals += 1
        if writer is not None:
            self._write(line, writer, step if log_step is None else int(log_step), picture)
        return reading

    def _line(self, first: int, step: int, interval: Interval, writer: Writer | None) -> dict[str, Any]:
        if not self.segments and writer is not None:
            self.segments = [[writer.branch, first]]
        line: dict[str, Any] = {"schema_version": LOAD_SCHEMA_VERSION, "step": step, "first_step": first,
                                "tokens": max((row["tokens"] for row in interval.layers), default=0),
                                "layers": interval.layers}
        if writer is not None:
            line.update(run_id=writer.run_id, branch=writer.branch)
        if self._uncounted is not None:
            line["uncounted"], self._uncounted = self._uncounted, None
        if interval.errors:
            line["errors"] = interval.errors
        return line

    def _write(self, line: dict[str, Any], writer: Writer, log_step: int, picture: bool) -> None:
        """``load.jsonl`` first, then the alerts (``alerts.jsonl``, every sink) and the trackers; a line the disk
        refuses waits in memory and is written in turn when it has room (:meth:`Writer.append`), and never stops
        training."""
        writer.append(LOAD, line, f"the training-batch load of steps {line['first_step']}-{line['step']}")
        for event in line["alerts"]:
            writer.delivery.alert(event)
        writer.delivery.load(line, load_metrics(line, self.cfg.top_experts), log_step, picture)

    def answered(self, record: dict[str, Any]) -> None:
        """A gate ran: it answers a pending early-gate request, and a baseline gate in post-training makes the next
        interval the alarm's reference."""
        if self.requested is not None and int(record["step"]) >= int(self.requested["step"]):
            self.requested = None
        if record.get("status") == "BASELINE" and record.get("phase") != "pretraining":
            self.alarm.rebase(int(record["step"]))

    def finish(self, pretraining: bool, writer: Writer | None) -> None:
        """The end of training: the interval since the last one, up to the last step seen (collective)."""
        if self.seen_step is not None:
            self.close(self.seen_step, pretraining, writer)


def trigger_fields(telemetry: Telemetry | None, trigger: str, loss_key: str | None) -> dict[str, Any]:
    """Why a gate runs and which loss it read (the record's ``trigger``, ``trigger_reason``, ``loss_key``): an early
    gate says what the alarm said; a scheduled gate that answers a pending request says so."""
    asked = telemetry.requested if telemetry is not None else None
    fields: dict[str, Any] = {"trigger": trigger, "loss_key": loss_key}
    if asked is not None and trigger == "telemetry":
        fields["trigger_reason"] = asked["text"]
    elif asked is not None:
        fields["trigger_reason"] = (f"it also answers the training-batch routing alarm of step {asked['step']}, "
                                    "which asked for an early gate")
    return fields
