"""``AtlasGate``: one object that runs a gate from any training loop.

It owns the whole per-gate flow, shared by the Lightning callback and by plain DeepSpeed or
Megatron-Core loops: measure the receipts (collectively, on every rank), keep or renew the
baseline, read the gate with the policy, evaluate alert rules, then on rank zero write the
local record (``<out_dir>/gates.jsonl``, first) and deliver to the trackers.

Example (plain loop):
    >>> import numpy as np, torch, tempfile
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> from atlas_tracking import Canary
    >>> from atlas_tracking.gate import AtlasGate
    >>> _ = torch.manual_seed(0)
    >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ...     head_dim=8, num_experts=8, num_experts_per_tok=2))
    >>> canary = Canary.from_token_ids(np.arange(2000) % 64, window=32, n_windows=8, seed=0)
    >>> gate = AtlasGate(model, canary, {"receipts": {"progress": False}}, out_dir=tempfile.mkdtemp())
    >>> gate.run(step=0, loss=4.1)["status"], gate.run(step=100, loss=3.9)["status"]
    ('BASELINE', 'GREEN')
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from atlas_tracking.adapters.base import RoutedLayer, find_routed_layers
from atlas_tracking.alerts import AlertEngine
from atlas_tracking.baseline import Baseline, BaselineError
from atlas_tracking.canary import Canary
from atlas_tracking.config import AtlasConfig
from atlas_tracking.measure import ForwardFn, default_forward, measure
from atlas_tracking.phases import model_vocab_size
from atlas_tracking.policy import GatePolicy, GateSummary
from atlas_tracking.record import gate_metrics, gate_record
from atlas_tracking.sinks import Delivery, JsonlSink, WebhookSink

log = logging.getLogger("atlas_tracking")


def _is_rank_zero() -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) or (
        torch.distributed.get_rank() == 0
    )


class AtlasGate:
    """Gates for a model on a fixed canary, with baseline, policy, local record and sinks."""

    def __init__(
        self,
        model: nn.Module,
        canary: Canary,
        config: AtlasConfig | dict | str | Path | None = None,
        *,
        out_dir: str | Path = "atlas",
        sinks: list[Any] | None = None,
        layers: list[RoutedLayer] | None = None,
        forward: ForwardFn = default_forward,
        keep_receipts: bool = True,
    ):
        self.model = model
        self.canary = canary
        self.config = AtlasConfig.coerce(config)
        self.out_dir = Path(out_dir)
        self.layers = layers if layers is not None else find_routed_layers(model)
        self.forward = forward
        self.keep_receipts = keep_receipts
        self.policy = GatePolicy(self.config)
        self.vocab_size = model_vocab_size(model)
        """Recorded with every gate: with the canary NLL it tells a freshly initialised model (phase auto)."""
        self.alerts = AlertEngine(self.config.alerts, self.config.lifecycle)
        self.baseline: Baseline | None = None
        self.baseline_path: str | None = None
        self._resume_pending = False
        self.gates_run = 0
        self.seconds_total = 0.0
        """Wall time spent in gates so far (measure, baseline, policy, delivery): the cost of monitoring."""
        extra = [] if sinks is None else list(sinks)
        webhook = WebhookSink.from_config(self.config.alerts.webhook_url, self.config.alerts.webhook_url_env)
        if webhook is not None:
            extra.append(webhook)
        self.local = JsonlSink(self.out_dir / "gates.jsonl")
        self.delivery = Delivery(self.local, extra)

    # --- lifecycle ---------------------------------------------------------------------------
    def add_sink(self, sink: Any) -> None:
        self.delivery.add(sink)

    def mark_resume(self) -> None:
        """The next gate is the first after a restart: it becomes a new BASELINE."""
        self._resume_pending = True

    @property
    def baseline_dir(self) -> Path:
        return self.out_dir / "baseline"

    def _load_existing_baseline(self) -> None:
        if self.baseline is None and self.baseline_path and Path(self.baseline_path).exists():
            try:
                self.baseline = Baseline.load(self.baseline_path)
            except BaselineError as exc:
                log.warning("atlas: cannot reuse baseline %s (%s); the next gate becomes the baseline", self.baseline_path, exc)
                self.baseline = None

    # --- one gate ----------------------------------------------------------------------------
    def run(self, step: int, loss: float | None = None) -> dict[str, Any]:
        """Measure, read and deliver one gate; returns the gate record (identical on every rank).

        The record's ``gate_seconds`` is the wall time of the measurement and its reading (the
        delivery that follows is added to ``seconds_total``).
        """
        t0 = time.perf_counter()
        self._load_existing_baseline()
        resume = self._resume_pending
        # In pretraining every gate becomes the next one's reference (RECEIPTS.md, Lifecycle phases).
        new_baseline = self.baseline is None or resume or self.policy.rolls_reference
        report = measure(
            self.model, self.canary, baseline=self.baseline, config=self.config, step=step,
            layers=self.layers, forward=self.forward, keep_anchors=new_baseline,
        )
        if new_baseline:
            self.baseline = Baseline.from_report(report)
            self.baseline_path = str(self.baseline_dir)
            if _is_rank_zero():
                self.baseline.save(self.baseline_dir)
        record = gate_record(report, None, step=step, loss=loss, resume=resume, baseline_path=self.baseline_path)
        record["vocab_size"] = self.vocab_size
        decision = self.policy.read(GateSummary.from_dict(record)).to_dict()
        events = [e.to_dict() if hasattr(e, "to_dict") else dict(e) for e in self.alerts.evaluate(decision, record)]
        decision["alerts"] = events
        record.update({k: v for k, v in decision.items() if k != "step"})
        self._resume_pending = False
        self.gates_run += 1
        record["gate_seconds"] = time.perf_counter() - t0
        if _is_rank_zero():
            self._deliver(record, report, events, step)
        self.seconds_total += time.perf_counter() - t0
        return record

    def _deliver(self, record: dict[str, Any], report: Any, events: list[dict[str, Any]], step: int) -> None:
        if self.keep_receipts:
            report.save(self.out_dir / "receipts" / f"step_{step:08d}.json")
        self.delivery.gate(record, gate_metrics(record, self.config.gate.log_per_layer), step)
        for event in events:
            self.delivery.alert(event)

    def record_failure(self, step: int, exc: BaseException) -> None:
        """Write a failed gate to ``errors.jsonl`` (the gate record stays replayable) and warn."""
        if not _is_rank_zero():
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / "errors.jsonl", "a") as fh:
            fh.write(json.dumps({"step": step, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def catch_up(self, until_step: int) -> int:
        """Replay local records newer than the restored state, up to the restored training step.

        A checkpoint can be written before the gate of its own step ran (e.g. at train-batch end);
        those gates are in ``gates.jsonl`` and belong to the restored timeline, so the policy and
        alert state are brought up to date from them (nothing is re-delivered). Returns the count.
        """
        records = self.local.records()
        last = self.policy.history[-1]["step"] if self.policy.history else -1
        caught = 0
        for rec in records:
            if last < rec["step"] <= until_step:
                decision = self.policy.read(GateSummary.from_dict(rec)).to_dict()
                self.alerts.evaluate(decision, rec)
                self.gates_run += 1
                caught += 1
        return caught

    def finish(self) -> None:
        self.delivery.finish()

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy.state_dict(),
            "alerts": self.alerts.state_dict(),
            "baseline_path": self.baseline_path,
            "baseline_canary": self.canary.fingerprint,
            "gates_run": self.gates_run,
        }

    def load_state_dict(self, state: dict[str, Any], resume: bool = True) -> None:
        """Restore policy and alert state; by default the next gate is a resume baseline."""
        self.policy.load_state_dict(state["policy"])
        self.alerts.load_state_dict(state["alerts"])
        self.baseline_path = state.get("baseline_path")
        self.gates_run = int(state.get("gates_run", 0))
        if state.get("baseline_canary") not in (None, self.canary.fingerprint):
            log.warning("atlas: the restored state was measured on another canary; its baseline is not reused")
            self.baseline_path = None
        self.baseline = None
        if resume:
            self.mark_resume()
