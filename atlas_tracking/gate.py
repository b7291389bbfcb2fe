"""``AtlasGate``: one object that runs a gate from any training loop.

It owns the whole per-gate flow, shared by the Lightning callback and by plain DeepSpeed or
Megatron-Core loops: measure the receipts (collectively, on every rank), keep or renew the
baseline, read the gate with the policy, evaluate alert rules, then on rank zero write the
local record (``<out_dir>/gates.jsonl``, first) and deliver to the trackers.

The record is one history per run (:mod:`atlas_tracking.artifacts.history`): a fresh gate never appends to
another run's directory (``gate.existing_record``), and :meth:`AtlasGate.resume` after a restart
moves gates of an abandoned branch aside, brings the policy up to date and lets the trackers
catch up. In a plain loop, keep ``gate.state_dict()`` in the checkpoint and resume with it::
    gate = AtlasGate(model, canary, "atlas.yaml", out_dir="atlas")
    if restored is not None:
        gate.resume(restored["step"], restored["atlas"])   # on every rank
    ...
    checkpoint["atlas"] = gate.state_dict()

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

import contextlib
import copy
import logging
import time
from pathlib import Path
from typing import Any

from torch import nn

from atlas_tracking.adapters.base import RoutedLayer, find_routed_layers
from atlas_tracking.artifacts.baseline import Baseline, BaselineError
from atlas_tracking.artifacts.gate_retention import pruned_reference, retention_plan
from atlas_tracking.artifacts.handoff_reference import HandoffReference, pinned_step
from atlas_tracking.artifacts.history import append_line, key, new_id, read_history
from atlas_tracking.artifacts.receipts_file import encode
from atlas_tracking.artifacts.record import gate_metrics, gate_record
from atlas_tracking.artifacts.retention import Plan, remove
from atlas_tracking.artifacts.run_dir import RunDir, RunDirError
from atlas_tracking.decisions.alerts import AlertEngine
from atlas_tracking.decisions.phases import model_vocab_size
from atlas_tracking.decisions.policy import GatePolicy, GateSummary
from atlas_tracking.decisions.protection import for_gate, record_fields
from atlas_tracking.engine.anchors import AnchorPlan
from atlas_tracking.engine.canary import Canary, check_canary_fits
from atlas_tracking.engine.collectives import bounded_gate
from atlas_tracking.engine.collectives import from_rank_zero as _from_rank_zero
from atlas_tracking.engine.measure import ForwardFn, anchor_storage, default_forward, measure
from atlas_tracking.engine.param_reference import ParamDriftError, ParamReference
from atlas_tracking.rollouts import Rollouts
from atlas_tracking.schema.artifacts import ALERTS, ERRORS
from atlas_tracking.schema.config import AtlasConfig
from atlas_tracking.sinks.commit import CommitOnWrite
from atlas_tracking.sinks.commit import is_rank_zero as _is_rank_zero
from atlas_tracking.sinks.delivery import Delivery
from atlas_tracking.sinks.held import Held, HeldGate
from atlas_tracking.sinks.jsonl import JsonlSink
from atlas_tracking.sinks.webhook import WebhookSink
from atlas_tracking.telemetry import Telemetry, Writer, trigger_fields

log = logging.getLogger("atlas_tracking")


def _no_progress(done: int, total: int) -> None:
    """Canary progress on ranks other than zero: nothing (rank zero prints it once for the gate)."""


class AtlasGate(CommitOnWrite):
    """Gates for a model on a fixed canary, with baseline, policy, local record and sinks."""

    def __init__(
        self,
        model: nn.Module,
        canary: Canary | str | Path,
        config: AtlasConfig | dict | str | Path | None = None,
        *,
        out_dir: str | Path = "atlas",
        sinks: list[Any] | None = None,
        layers: list[RoutedLayer] | None = None,
        forward: ForwardFn = default_forward,
        keep_receipts: bool = True,
    ):
        self.model = model
        self.canary = Canary.coerce(canary)
        self.config = AtlasConfig.coerce(config)
        check_canary_fits(model, self.canary)
        self.run_dir = RunDir(out_dir)
        self.layers = layers if layers is not None else find_routed_layers(model)
        rcfg = self.config.receipts  # a baseline budget no storage form fits fails now, before training starts
        anchor_storage(rcfg, self.layers, AnchorPlan.select(self.canary, rcfg.anchors, rcfg.seed))
        self.handoff_reference = self._declared_reference()
        """The declared healthy reference of the handoff margin (``lifecycle.handoff_reference``), or None."""
        self.forward = forward
        self.keep_receipts = keep_receipts
        self.policy = GatePolicy(self.config)
        self.vocab_size = model_vocab_size(model)
        """Recorded with every gate: with the canary NLL it tells a freshly initialised model (phase auto)."""
        self.alerts = AlertEngine(self.config.alerts, self.config.lifecycle)
        self.baseline: Baseline | None = None
        self.baseline_path: str | None = None
        self.committed_baseline_path: str | None = None
        """The baseline the last written gate names (what :meth:`state_dict` keeps)."""
        self.base: Baseline | None = None
        self.base_path: str | None = None
        """The post-training base: the first post-training baseline (the handoff), kept across resumes, against
        which every later gate reports its cumulative base damage (docs/receipts.md#base-domain-damage)."""
        self.param_reference = ParamReference(self.config.gate.param_drift_budget_bytes)
        """The parameters at the baseline (host copy), for the parameter drift beside the atlas drift."""
        self.run_id: str | None = None
        """The run's identity, constant across resumes (set when the run directory is claimed)."""
        self.branch = new_id()
        """This training segment: every record it writes carries it."""
        self.lineage: list[list[Any]] = []
        """(step, branch) of every gate in this state's history, in order."""
        self.gates_run = 0
        self.seconds_total = 0.0
        """Wall time spent in gates so far (measure, baseline, policy, delivery): the cost of monitoring."""
        self._read_at: float | None = None
        """When this process last finished reading a gate (``time.perf_counter``): where ``gate_share``'s stretch
        begins."""
        self._resume_pending = False
        self._claimed = False
        self._restored: dict[str, Any] | None = None
        self._canary_changed_from: str | None = None
        extra = [] if sinks is None else list(sinks)
        webhook = WebhookSink.from_config(self.config.alerts.webhook_url, self.config.alerts.webhook_url_env)
        if webhook is not None:
            extra.append(webhook)
        self.local = JsonlSink(self.run_dir.gates)
        self.delivery = Delivery(self.local, extra, wait_s=self.config.gate.delivery_wait_s)
        self.held = Held(self.local)
        """Writes of the record that wait for the disk (:mod:`atlas_tracking.sinks.held`): a gate commits once written."""
        self._reference_note: str | None = None
        """Why gates measure against an older baseline: the last one taken could not be written."""
        self.telemetry = Telemetry(self.layers, self.config) if self.config.telemetry.enabled else None
        """Training-batch routing between gates (docs/telemetry.md): counting hooks from now on."""
        self.rollouts = Rollouts(self.layers, self.config) if self.config.rollout.enabled else None
        """Rollout agreement a reinforcement-learning loop hands over (:meth:`rollout`, docs/rollout.md)."""

    def _declared_reference(self) -> HandoffReference | None:
        """Read and check ``lifecycle.handoff_reference`` now, so a wrong reference fails before training starts
        (:class:`~atlas_tracking.artifacts.handoff_reference.HandoffReferenceError` names the difference). A pinned
        gate of this run (``gate:N``) is read once that gate has run (:meth:`_pinned_reference`)."""
        spec = self.config.lifecycle.handoff_reference
        if spec is None or pinned_step(spec) is not None:
            return None
        return self._checked(HandoffReference.load(spec))

    def _checked(self, reference: HandoffReference) -> HandoffReference:
        reference.check_compatible([layer.describe() for layer in self.layers], type(self.model).__name__,
                                   self.canary.fingerprint)
        return reference

    def _pinned_reference(self) -> None:
        """With ``handoff_reference: gate:N``, this run's receipts of gate N become the reference once they exist
        (read on rank zero and shared, so every rank reads its margin against the same reference)."""
        step = pinned_step(self.config.lifecycle.handoff_reference)
        if step is None or self.handoff_reference is not None:
            return
        found: Any = None
        if _is_rank_zero():
            path = self.run_dir.receipts_file(step)
            if path.exists() and any(int(s) == step for s, _ in self.lineage):
                found = self._checked(HandoffReference.load(path))
        self.handoff_reference = _from_rank_zero(found)

    def _measure(self, step: int, config: AtlasConfig, keep_anchors: bool) -> Any:
        """One measurement against the baseline, the handoff margin against the declared reference if any, and
        the base damage against the post-training base."""
        base = None
        if self.baseline is not None and self.base_path is not None:
            base = self.baseline if self.base_path == self.baseline_path else self._load_base()
        with self.telemetry.counter.paused() if self.telemetry else contextlib.nullcontext():  # a gate is no training
            return measure(self.model, self.canary, baseline=self.baseline, config=config, step=step,
                           layers=self.layers, forward=self.forward, keep_anchors=keep_anchors,
                           progress=None if _is_rank_zero() else _no_progress,
                           handoff_reference=self.handoff_reference.layers if self.handoff_reference else None,
                           base=base)

    def _load_base(self) -> Baseline | None:
        """The post-training base, read once; a base that cannot be read is a warning and the gate goes on without
        cumulative damage (the record then has no ``base_step``)."""
        if self.base is None and self.base_path is not None:
            try:
                self.base = Baseline.load(self.base_path)
            except BaselineError as exc:
                log.warning("atlas: cannot read the post-training base %s (%s); no damage since the base at this gate",
                            self.base_path, exc)
        return self.base

    def _keep_base(self, record: dict[str, Any]) -> None:
        """The first post-training baseline on disk becomes the base and stays it across resumes."""
        path = record.get("baseline_path")
        if (self.base_path is None and path is not None and record["status"] == "BASELINE"
                and record.get("phase") == "post_training" and "reference_fallback" not in record):
            self.base_path, self.base = path, self.baseline if path == self.baseline_path else None

    # --- the run directory ------------------------------------------------------------------
    @property
    def out_dir(self) -> Path:
        return self.run_dir.path

    def add_sink(self, sink: Any) -> None:
        self.delivery.add(sink)

    def mark_resume(self) -> None:
        """The next gate is the first after a restart: it becomes a new BASELINE."""
        self._resume_pending = True

    def claim(self) -> Path:
        """Take the run directory for this run (collective); returns the directory the record goes to.

        A directory that holds another run's record is never appended to: with
        ``gate.existing_record: new_dir`` (default) the record goes to the first free sibling
        ``<out_dir>-2``, ``-3``, ... (a warning names it); with ``refuse`` it is a :class:`RunDirError`.
        """
        if self._claimed:
            return self.out_dir
        try:
            decision = self._choose_dir() if _is_rank_zero() else None
        except (RunDirError, OSError) as exc:  # a full disk cannot take run.json: every rank hears it
            decision = exc
        decision = _from_rank_zero(decision)
        if isinstance(decision, Exception):
            raise decision
        path, self.run_id, self.branch = decision
        self.run_dir = RunDir(path)
        self.local.path = self.run_dir.gates
        self._claimed = True
        return self.out_dir

    def _choose_dir(self) -> tuple[str, str, str]:
        run_id = (self._restored or {}).get("run_id") or self.run_id or new_id()
        adopt_legacy = self._restored is not None and not self._restored.get("run_id")
        path = self.run_dir.choose(run_id, adopt_legacy, self.config.gate.existing_record)
        RunDir(path).write_identity(run_id, self.canary.fingerprint)
        return str(path), run_id, self.branch

    def _load_existing_baseline(self) -> None:
        if self.baseline is None and self.baseline_path and Path(self.baseline_path).exists():
            try:
                self.baseline = Baseline.load(self.baseline_path)
            except BaselineError as exc:
                log.warning("atlas: cannot reuse baseline %s (%s); the next gate becomes the baseline", self.baseline_path, exc)
                self.baseline = None

    # --- one gate ----------------------------------------------------------------------------
    @bounded_gate
    def run(self, step: int, loss: float | None = None, *, log_step: int | None = None, trigger: str = "validation",
            loss_key: str | None = None, direction: str | None = None) -> dict[str, Any]:
        """Measure, read and deliver one gate; returns the gate record.

        ``step`` is the training step (the record's key); ``log_step`` the step trackers plot it at
        when the training framework logs its own metrics at another step (default ``step``). ``trigger`` says why
        the gate runs (``start``, ``validation``, ``telemetry``: an early gate the alarm asked for), ``loss_key``
        which metric ``loss`` is and ``direction`` how it improves (default: ``objective`` in the config,
        :meth:`~atlas_tracking.schema.config.ObjectiveConfig.direction_for`); all go to the record. The
        record's ``gate_seconds`` is the wall time of the measurement and its reading (the delivery
        that follows is added to ``seconds_total``), ``gate_share`` that time over the wall time since this process
        last read a gate. The returned record is the same on every rank except each rank's own wall times
        (``gate_seconds``, ``gate_share``) and ``receipts_sha256``, which rank zero adds when it writes the receipts.

        A gate commits when its line is durably in ``gates.jsonl``: only then do the policy's state, the lineage and
        :meth:`state_dict` advance. An ``OSError`` (a full disk) never stops training: the gate is held in memory
        (written whole, and committed, as soon as the disk has room, :mod:`atlas_tracking.sinks.held`), recorded as a
        failed gate (:meth:`record_failure`), and ``run`` returns that failure: ``status`` ``FAILED``, ``step``,
        ``error`` (naming the file and the free space) and ``waiting`` (records held in memory).
        """
        try:
            return self._run(step, loss, log_step, trigger, loss_key, direction)
        except OSError as exc:  # monitoring never stops training
            line = self.record_failure(step, exc, log_step)
            return {**line, "status": "FAILED", "waiting": self.held.waiting()}

    def _run(self, step: int, loss: float | None, log_step: int | None, trigger: str, loss_key: str | None,
             direction: str | None) -> dict[str, Any]:
        self.claim()
        self._flush()  # a gate held for the disk is written (and commits) before this one is read
        self._close_interval(step, log_step)  # no interval of training-batch load straddles a gate
        t0 = time.perf_counter()
        self._load_existing_baseline()
        self._pinned_reference()
        resume = self._resume_pending
        pruned = _from_rank_zero(pruned_reference(self.baseline_path) if _is_rank_zero() else None) if resume else None
        # In pretraining every gate becomes the next one's reference (docs/policy.md#lifecycle-phases).
        new_baseline = self.baseline is None or resume or self.policy.rolls_reference
        config, protection = self._protection(step)
        report = self._measure(step, config, new_baseline)
        param_drift = self._param_drift(step, new_baseline)
        fallback = self._reference_note  # the last baseline taken is not on disk: this gate measured without it
        if new_baseline:
            fallback = self._take_baseline(step, report) or fallback
        record = gate_record(report, None, step=step, loss=loss, resume=resume,
                             baseline_path=self.baseline_path if self.baseline is not None else None)
        # the gate's identity early in its line: a line a crash cuts short still names it (artifacts/rebuild.py)
        head = {"schema_version": record["schema_version"], "step": record["step"], "run_id": self.run_id,
                "branch": self.branch, "loss": record["loss"], "resume": record["resume"]}
        if "baseline_path" in record:
            head["baseline_path"] = record["baseline_path"]
        record = {**head, **record}
        record.update(protection)
        if fallback is not None:
            record["reference_fallback"] = fallback
        if self.handoff_reference is not None:
            record["handoff_reference"] = self.handoff_reference.source
        if param_drift is not None:
            record["param_drift"] = param_drift
        if log_step is not None:
            record["log_step"] = int(log_step)
        if resume and self._canary_changed_from:
            record["canary_changed_from"] = self._canary_changed_from
        if pruned is not None:
            record["reference_pruned"] = pruned
        record["vocab_size"] = self.vocab_size
        record.update(trigger_fields(self.telemetry, trigger, loss_key), objective_direction=self._direction(direction, loss_key))
        ahead = self.held.ahead() or {"policy": self.policy, "alerts": self.alerts}  # read after any held gate
        policy, alerts = copy.deepcopy(ahead["policy"]), copy.deepcopy(ahead["alerts"])
        decision = policy.read(GateSummary.from_dict(record)).to_dict()
        events = [e.to_dict() for e in alerts.evaluate(decision, record)]
        decision["alerts"] = events
        record.update({k: v for k, v in decision.items() if k != "step"})
        if self.telemetry is not None:
            self.telemetry.answered(record)
        self._resume_pending = False
        self._canary_changed_from = None
        read_at = time.perf_counter()
        record["gate_seconds"] = read_at - t0
        if self._read_at is not None:
            record["gate_share"] = record["gate_seconds"] / (read_at - self._read_at)
        self._read_at = read_at
        lineage = [*self.lineage, *([h.record["step"], h.record["branch"]] for h in self.held.gates), [step, self.branch]]
        plan, retained = _from_rank_zero(retention_plan(self.run_dir, self.config, lineage, [
            self.baseline_path, self.base_path]) if _is_rank_zero() else None)  # the lineage once this gate commits
        record.update(retained)  # named in the record before anything is removed
        receipts = (self.run_dir.receipts_writer(step, encode(report.to_dict(), self.config.gate.receipts_format,
                    self.config.gate.receipts_binary_above)) if _is_rank_zero() and self.keep_receipts else None)
        self.held.hold(HeldGate(record, gate_metrics(record, self.config.gate.log_per_layer), self._tracker_step(record),
                                events, receipts, {"policy": policy, "alerts": alerts, "plan": plan}))
        error = self._flush()
        self.seconds_total += time.perf_counter() - t0
        if any(held.record is record for held in self.held.gates):
            raise OSError(f"{error}; the gate at step {step} is held in memory and written as soon as the disk "
                          "has room")
        return record

    # --- between gates (atlas_tracking/telemetry.py) -----------------------------------------------
    @bounded_gate
    def step(self, step: int, *, loss: float | None = None, log_step: int | None = None,
             early: bool = True) -> dict[str, Any] | None:
        """An optimizer step has ended (call it on every rank, after any gate of this step): the training-batch
        load interval closes when it is due (``telemetry.every_n_steps``), and when the alarm asks for an early gate
        it runs now with ``loss`` (``early``; a callback runs it at the next boundary instead). Returns that
        gate's record, or None. Never raises: a failed early gate is recorded as one (:meth:`record_failure`)."""
        if self.held.waiting():
            with contextlib.suppress(Exception):  # a write that still fails waits for the next call
                self._flush()
        if self.telemetry is None or not self._claim_quietly():
            return None
        asked = self.telemetry.step(step, self.policy.rolls_reference, self._writer(), log_step)
        if not (asked and early):
            return None
        last = [*self.lineage, *([h.record["step"]] for h in self.held.gates)]  # a held gate answered it too
        if last and int(last[-1][0]) >= int(step):  # a gate of this step already answered it
            self.telemetry.requested = None
            return None
        try:
            return self.run(step, loss, log_step=log_step, trigger="telemetry")
        except Exception as exc:  # monitoring never stops training: the failure is the alarm now
            self.telemetry.requested = None
            self.record_failure(step, exc, log_step)
            return None

    def _claim_quietly(self) -> bool:
        """:meth:`claim` between gates: a run directory that cannot be written yet is an error line, not a raise."""
        try:
            self.claim()
        except OSError as exc:  # a full disk: the next gate tries again
            log.debug("atlas: the run directory cannot be written yet: %s", exc)  # each gate says so
            return False
        return True

    def _writer(self) -> Writer | None:
        if not _is_rank_zero():
            return None
        return Writer(self.run_dir.path, self.run_id, self.branch, self.delivery, self.held)

    @bounded_gate
    def rollout(self, step: int, input_ids: Any, routed_experts: Any, attention_mask: Any = None,
                **options: Any) -> dict[str, Any] | None:
        """A reinforcement-learning loop hands over the batch it trains on at ``step`` and the routed experts its
        rollout engine returned (call it on every rank, each with its own batch; docs/rollout.md#in-a-training-loop):
        measured every ``rollout.every_n_steps`` steps, written to ``rollout.jsonl``, delivered, read by the alarm.
        ``options`` are :meth:`~atlas_tracking.rollouts.Rollouts.record`'s. Returns the line, or None; never raises."""
        if self.rollouts is None or not self.rollouts.due(step) or not self._claim_quietly():
            return None
        return self.rollouts.guarded(self.model, step, self._writer(), input_ids, routed_experts, attention_mask,
                                     **options)

    def _close_interval(self, step: int, log_step: int | None) -> None:
        if self.telemetry is not None:
            self.telemetry.close(step, self.policy.rolls_reference, self._writer(), log_step)

    def _direction(self, direction: str | None, loss_key: str | None) -> str:
        """The objective's direction a gate records: the one given, else the configuration's for ``loss_key``."""
        return direction or self.config.objective.direction_for(loss_key)

    def _protection(self, step: int) -> tuple[AtlasConfig, dict[str, Any]]:
        """The configuration the gate at ``step`` measures with and the record fields of its protected set,
        read against the run's history on rank zero and shared with every rank
        (:mod:`atlas_tracking.decisions.protection`): with ``protected_layers: auto`` the set the run chose
        once (``mid`` until then), else the configuration as it is; a set that differs from the previous
        gate's is recorded as ``protected_change``."""
        names = [layer.name for layer in self.layers]
        chosen = for_gate(self.run_dir.path if self._claimed else None, self.canary.fingerprint, names,
                          self.config.lifecycle, step=step,
                          pretraining=self.policy.rolls_reference) if _is_rank_zero() else None
        chosen = _from_rank_zero(chosen)
        if not chosen["auto"]:
            return self.config, record_fields(chosen)
        config = copy.deepcopy(self.config)
        config.lifecycle.protected_layers = list(chosen["ordinals"])
        return config, record_fields(chosen)

    def _param_drift(self, step: int, new_baseline: bool) -> dict[str, Any] | None:
        """The parameter drift against the reference (when one is kept), then a new reference at a new
        baseline (collective). A mismatch with the reference is a warning, never a failed gate."""
        if not self.config.gate.param_drift:
            return None
        drift = None
        if self.param_reference.ready:
            try:
                drift = self.param_reference.measure(self.model)
            except ParamDriftError as exc:
                log.warning("atlas: no parameter drift at step %s: %s", step, exc)
        if new_baseline:
            self.param_reference.take(self.model, self.layers, step=step)
        return drift

    # --- retention (docs/record.md#retention) ------------------------------------------------------
    def _prune(self, plan: Plan) -> None:
        """Remove what the record line just written names; a failure is a warning (the next gate tries again)."""
        gone = plan.baselines + plan.receipts
        try:
            remove(self.run_dir.path, gone)
        except Exception as exc:  # monitoring never stops training
            log.warning("atlas: retention could not remove %s (%s); the next gate tries again", gone, exc)
            return
        if gone:
            log.info("atlas: retention pruned %s, freeing %d bytes (gate.keep_baselines: %s, gate.keep_receipts: %s)",
                     ", ".join(gone), plan.bytes, self.config.gate.keep_baselines, self.config.gate.keep_receipts)

    def _tracker_step(self, record: dict[str, Any]) -> int:
        return int(record.get("log_step", record["step"]))

    def record_failure(self, step: int, exc: BaseException, log_step: int | None = None) -> dict[str, Any]:
        """A gate that could not run is an alarm: an ERROR alert (:meth:`AlertEngine.failure`) counted with the
        failures before it, written to ``errors.jsonl`` first (the ground truth of failures; ``gates.jsonl``
        stays replayable), then to ``alerts.jsonl``, the Python log and every tracker, whose status becomes
        ``FAILED`` until a gate runs again. The policy's state is kept. Call it on every rank (rank zero writes);
        returns the ``errors.jsonl`` line (:class:`~atlas_tracking.schema.record.FailedGate`)."""
        error = f"{type(exc).__name__}: {exc}"
        layers = [layer.name for layer in self.layers if f"{layer.name} (" in str(exc)]
        alerts = (self.held.ahead() or {"alerts": self.alerts})["alerts"]  # counted after any gate still held
        event = alerts.failure(int(step), error, layers).to_dict()
        line: dict[str, Any] = {"step": int(step), "error": error, "failed_layers": layers,
                                "consecutive": event["failed"]["count"], "first_failed_step": event["failed"]["first_step"],
                                "run_id": self.run_id, "branch": self.branch, "alerts": [event]}
        if log_step is not None:
            line["log_step"] = int(log_step)
        if not _is_rank_zero():
            return line
        self.held.line(ERRORS, line)  # the record first, as soon as the disk takes it; the trackers at once
        self.held.line(ALERTS, event)
        if self._claimed:
            self.held.flush_lines()
        waiting = self.held.waiting()
        if waiting:
            event = {**event, "text": f"{event['text']} {waiting} record(s) of this run wait in memory for the disk "
                                      f"to have room ({self.held.error or 'the run directory is not claimed'})."}
        log.error("atlas alert [ERROR] %s: %s", event["title"], event["text"])
        self.delivery.notify(event)
        return line

    @bounded_gate
    def evaluate(self, step: int, loss: float | None = None, kind: str = "validate", *, loss_key: str | None = None,
                 direction: str | None = None) -> dict[str, Any]:
        """A gate outside the training history (``trainer.validate()`` / ``trainer.test()``).

        Measured like a gate and read against the run's baseline on a copy of the policy, so the
        run's stage does not move; written to ``evaluations.jsonl`` (with ``kind``) on rank zero,
        never to ``gates.jsonl``, and not delivered to trackers.
        """
        self._load_existing_baseline()
        config, protection = self._protection(step)
        report = self._measure(step, config, False)
        record = gate_record(report, None, step=step, loss=loss,
                             baseline_path=self.baseline_path if self.baseline is not None else None)
        record.update(kind=kind, run_id=self.run_id, branch=self.branch, loss_key=loss_key,
                      objective_direction=self._direction(direction, loss_key), **protection)
        if self.handoff_reference is not None:
            record["handoff_reference"] = self.handoff_reference.source
        decision = copy.deepcopy(self.policy).read(GateSummary.from_dict(record)).to_dict()
        record.update({k: v for k, v in decision.items() if k != "step"})
        if _is_rank_zero():
            append_line(self.run_dir.evaluations, record)
            log.info("atlas %s gate step=%s status=%s (written to %s; not part of the training history)",
                     kind, step, record["status"], self.run_dir.evaluations)
        return record

    # --- restart -----------------------------------------------------------------------------
    @bounded_gate
    def resume(self, step: int, state: dict[str, Any]) -> dict[str, int]:
        """Continue a run from a training state saved by :meth:`state_dict`, restored at ``step``.

        Collective (call it on every rank). Restores the policy and alert state, claims the run
        directory (the same run), writes what still waits for the disk (a resume in the same process: the record of
        the segment it came from, never committed), makes the record the history of the restored state (gates of
        an abandoned branch move to ``gates.abandoned.jsonl``, their receipts follow), replays the
        gates that ran after the state was saved up to ``step`` (a checkpoint written before its
        own gate), marks the next gate as a resume baseline, and lets every tracker run catch up
        with the gates of the history it has not received. Returns the counts.
        """
        self.load_state_dict(state)
        self.claim()
        self._file_held(int(step))
        payload: Any = None
        if _is_rank_zero():
            repaired, moved, rewound = {}, 0, False
            try:
                repaired = self.run_dir.repair()
                lineage = self._restored.get("lineage") if self._restored else None
                moved = self.run_dir.rewind(int(step), lineage, (self._restored or {}).get("branch"),
                                            ((self._restored or {}).get("telemetry") or {}).get("segments"),
                                            ((self._restored or {}).get("rollout") or {}).get("segments"))
                rewound = True
            except OSError as exc:  # a full disk: training starts anyway, and the next resume rewinds the record
                log.error("atlas: the record could not be rewound to step %s (%s); the next resume does it", step, exc)
            history = read_history(self.run_dir.path) if self.run_dir.gates.exists() else []
            payload = (moved, [r for r in history if rewound or r["step"] <= step], repaired)
        moved, history, repaired = _from_rank_zero(payload)
        read = self.lineage or self.policy.history  # a state saved before lineages were kept has only the latter
        last = int(read[-1][0] if self.lineage else read[-1]["step"]) if read else -1
        caught = 0
        for rec in history:
            if last < rec["step"] <= step:
                decision = self.policy.read(GateSummary.from_dict(rec)).to_dict()
                self.alerts.evaluate(decision, rec)
                self.gates_run += 1
                caught += 1
        self.lineage = [list(key(rec)) for rec in history]
        if self.telemetry is not None:
            self.telemetry.resume(int(step), (self._restored or {}).get("telemetry"), self.branch)
        if self.rollouts is not None:
            self.rollouts.resume(int(step), (self._restored or {}).get("rollout"), self.branch)
        self.mark_resume()
        delivered = 0
        if _is_rank_zero():
            delivered = self.delivery.catch_up(
                history, lambda r: gate_metrics(r, self.config.gate.log_per_layer), self._tracker_step)
        return {"moved_aside": moved, "caught_up": caught, "redelivered": delivered, **repaired}

    def finish(self) -> None:
        """The end of training (on every rank): the training-batch load since the last interval is written, then
        the trackers are waited for (boundedly) and a backlog reported."""
        if self.telemetry is not None:
            try:
                self.telemetry.finish(self.policy.rolls_reference, self._writer())
            except Exception as exc:  # monitoring never stops training, nor its end
                log.error("atlas: the last training-batch load interval could not be closed: %s: %s",
                          type(exc).__name__, exc)
        try:
            self._flush()  # the last chance for what waits for the disk
        except Exception as exc:  # monitoring never stops training, nor its end
            log.error("atlas: the record could not be written at the end of training: %s: %s", type(exc).__name__, exc)
        if self.held.waiting():
            log.error("atlas: training ended with %d record(s) the disk had no room for (%s): they are lost; the "
                      "history and the checkpointed state end at the last gate written (step %s)",
                      self.held.waiting(), self.held.error, self.lineage[-1][0] if self.lineage else None)
        self.delivery.finish()

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy.state_dict(),
            "alerts": self.alerts.state_dict(),
            "baseline_path": self.committed_baseline_path,
            "base_path": self.base_path,
            "canary_fingerprint": self.canary.fingerprint,
            "gates_run": self.gates_run,
            "run_id": self.run_id,
            "branch": self.branch,
            "lineage": [list(k) for k in self.lineage],
            **({"telemetry": self.telemetry.state_dict()} if self.telemetry is not None else {}),
            **({"rollout": self.rollouts.state_dict()} if self.rollouts is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore policy and alert state (use :meth:`resume` after a restart: it calls this).

        A state measured on another canary is a loud re-baseline: its baseline is not reused (it
        stays where it is), and the next gate records ``canary_changed_from`` and raises the
        ``alerts.on_canary_change`` alert naming both fingerprints.
        """
        self.policy.load_state_dict(state["policy"])
        self.alerts.load_state_dict(state["alerts"])
        self.baseline_path = self.committed_baseline_path = state.get("baseline_path")
        self.base_path, self.base = state.get("base_path"), None
        self.gates_run = int(state.get("gates_run", 0))
        self.lineage = [list(k) for k in state.get("lineage", [])]
        if state.get("run_id"):
            self.run_id = state["run_id"]
        self._restored = state
        before = state.get("canary_fingerprint", state.get("baseline_canary"))
        if before is not None and before != self.canary.fingerprint:
            self._canary_changed_from = before
            log.warning("atlas: the restored state was measured on canary %s, this run's canary is %s: the next gate "
                        "is a new baseline on the new canary (the old baseline is kept at %s)",
                        before[:16], self.canary.fingerprint[:16], self.baseline_path)
            self.baseline_path = None
            if self.base_path is not None:
                log.warning("atlas: the post-training base %s was measured on the old canary: the next post-training "
                            "baseline becomes the base on the new canary", self.base_path)
            self.base_path = None
        self.baseline = None
        self.param_reference.clear()  # the next gate is a new baseline: parameter drift starts from it
