"""Alert rules: stage alerts of the staged escalation plus user threshold rules (plain events).

Defaults: entering ``revoked`` (WARN), entering ``intervene`` (ERROR), a resume baseline (INFO),
a re-baseline after a canary change (INFO, naming both fingerprints) and recovery back to
``clean`` (INFO); a gate that could not run (ERROR, :meth:`AlertEngine.failure`) and the first gate that runs
after it (INFO, naming how many failed); in pretraining, entering ``collapse`` (occupancy collapse, WARN) and entering
``ready`` (handoff readiness, INFO); in post-training, a predicate turning ``fail``: protected-atlas
rewrite (WARN) and base-domain damage (WARN). Levels come from :class:`~atlas_tracking.schema.config.AlertsConfig`
and "off" disables one. Threshold rules (``dead_experts > 64 on any protected layer``) fire at
most once per ``min_interval_steps``. Trackers deliver the events elsewhere.

Example:
    >>> from atlas_tracking.schema.config import AtlasConfig
    >>> cfg = AtlasConfig.from_dict({"alerts": {"rules": [{"metric": "dead_experts", "op": ">", "value": 2,
    ...                                                     "scope": "any_layer", "min_interval_steps": 100}]}})
    >>> engine = AlertEngine(cfg.alerts, cfg.lifecycle)
    >>> rec = {"step": 10, "layers": [{"name": "l0", "dead_experts": 3, "protected": True}]}
    >>> [e.title for e in engine.evaluate({"step": 10, "stage": "revoked", "status": "YELLOW"}, rec)]
    ['atlas: run entered revoked at step 10', 'atlas: dead_experts > 2 (any_layer)']
    >>> [e.title for e in engine.evaluate({"step": 50, "stage": "revoked", "status": "YELLOW"}, {**rec, "step": 50})]
    []
"""

from __future__ import annotations

import copy
import operator
from dataclasses import asdict, dataclass
from typing import Any

from atlas_tracking.artifacts.expert_text import expert_lines
from atlas_tracking.schema.config import AlertRule, AlertsConfig, LifecycleConfig
from atlas_tracking.schema.record import BAD_STAGES, Stage, Status

NAMES_EXPERTS = ("stage:revoked", "stage:intervene", "stage:collapse")
"""The stage alerts whose text names the dead and overloaded experts per layer (threshold rules do too)."""
_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq}
TITLE_MAX = 63


@dataclass
class AlertEvent:
    """One alert: title (< 64 characters, as W&B requires), text, level and de-duplication key."""

    title: str
    text: str
    level: str
    key: str
    step: int
    wait_duration_s: float
    failed: dict[str, Any] | None = None
    """A gate failure or its clearing: the failed state (``count``, ``first_step``, ``last_step``, ``layers``,
    ``error``; ``cleared_step`` once a gate runs again), what trackers show as the run's failed state."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["failed"] is None:
            del d["failed"]
        return d


def _title(text: str) -> str:
    return text if len(text) <= TITLE_MAX else text[: TITLE_MAX - 1] + "…"


class AlertEngine:
    """Turns gate decisions and records into alert events; its state is a plain dict."""

    def __init__(self, config: AlertsConfig | None = None, lifecycle: LifecycleConfig | None = None):
        self.cfg = config or AlertsConfig()
        self.lifecycle = lifecycle or LifecycleConfig()
        self.last_stage: str | None = None
        self.last_fired: dict[str, int] = {}
        self.last_verdicts: dict[str, str] = {}
        """The predicates' verdicts at the last gate that read them."""
        self.failing: dict[str, Any] | None = None
        """The consecutive gates that could not run since the last gate that ran (None: the last gate ran)."""

    def state_dict(self) -> dict[str, Any]:
        return {"last_stage": self.last_stage, "last_fired": dict(self.last_fired),
                "last_verdicts": dict(self.last_verdicts), "failing": copy.deepcopy(self.failing)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_stage = state.get("last_stage")
        self.last_fired = {k: int(v) for k, v in state.get("last_fired", {}).items()}
        self.last_verdicts = dict(state.get("last_verdicts", {}))
        self.failing = copy.deepcopy(state.get("failing"))

    def _event(self, level: str, title: str, text: str, key: str, step: int) -> AlertEvent:
        return AlertEvent(_title(title), text, level, key, step, self.cfg.wait_duration_s)

    def _stage_events(self, decision: dict[str, Any], record: dict[str, Any]) -> list[AlertEvent]:
        step, stage, prev = int(decision["step"]), decision.get("stage"), self.last_stage
        out = []
        changed_from = record.get("canary_changed_from")
        if decision.get("status") == Status.BASELINE and changed_from and self.cfg.on_canary_change != "off":
            now = record.get("canary_fingerprint") or "?"
            out.append(self._event(
                self.cfg.on_canary_change, f"atlas: canary changed, re-baseline at step {step}",
                f"The canary changed from {changed_from[:16]} to {now[:16]}: the gate at step {step} is a new "
                f"baseline on the new canary (stage before resume: {decision.get('stage_before_resume')}); receipts "
                "are never compared across canaries, and the previous baseline is kept.",
                "canary_change", step))
        elif decision.get("status") == Status.BASELINE and record.get("resume") and self.cfg.on_resume_baseline != "off":
            handoff = (f" Phase {decision['phase_before_resume']} -> {decision.get('phase')}: this gate is the "
                       f"{decision.get('phase')} baseline." if decision.get("phase_before_resume") else "")
            out.append(self._event(
                self.cfg.on_resume_baseline, f"atlas: resume baseline at step {step}",
                f"Training resumed; the gate at step {step} is a new baseline (stage before resume: "
                f"{decision.get('stage_before_resume')}). Preservation is untested until the next gate.{handoff}",
                "resume_baseline", step))
        entered = stage != prev
        if entered and stage == Stage.revoked and self.cfg.on_revoked != "off":
            out.append(self._event(self.cfg.on_revoked, f"atlas: run entered revoked at step {step}",
                                   f"{decision.get('action', '')} {decision.get('interpretation', '')}".strip(),
                                   "stage:revoked", step))
        if entered and stage == Stage.intervene and self.cfg.on_intervene != "off":
            out.append(self._event(self.cfg.on_intervene, f"atlas: intervene at step {step}",
                                   f"{decision.get('action', '')} First intervention: {decision.get('intervention')}",
                                   "stage:intervene", step))
        if entered and stage == Stage.collapse and self.cfg.on_collapse != "off":
            out.append(self._event(self.cfg.on_collapse, f"atlas: occupancy collapse at step {step}",
                                   f"{decision.get('interpretation', '')} {decision.get('action', '')}".strip(),
                                   "stage:collapse", step))
        if entered and stage == "ready" and self.cfg.on_handoff_ready != "off":
            margin = (decision.get("handoff") or {}).get("margin")
            out.append(self._event(self.cfg.on_handoff_ready, f"atlas: handoff ready at step {step}",
                                   f"{decision.get('interpretation', '')} Handoff margin "
                                   f"{'n/a' if margin is None else f'{margin:+.4f}'}.", "stage:ready", step))
        if entered and stage == Stage.clean and prev in (Stage.recovering, *BAD_STAGES) \
                and self.cfg.on_recovered != "off":
            what = (f"Occupancy recovered over repeated gates ({record['c2_absent']}: no C2)."
                    if record.get("c2_absent") else "C2 and occupancy recovered jointly over repeated gates.")
            out.append(self._event(self.cfg.on_recovered, f"atlas: recovered to clean at step {step}", what,
                                   "stage:clean", step))
        return out

    def _predicate_events(self, decision: dict[str, Any], step: int) -> list[AlertEvent]:
        """A predicate that turns ``fail`` (not while it stays failed): protected-atlas rewrite, base damage."""
        out = []
        for name, level, what in (("protected_rewrite", self.cfg.on_rewrite, "protected atlas rewritten"),
                                  ("base_damage", self.cfg.on_base_damage, "base-domain damage")):
            verdict = ((decision.get("predicates") or {}).get(name) or {}).get("verdict")
            if verdict is None:
                continue
            if verdict == "fail" and self.last_verdicts.get(name) != "fail" and level != "off":
                out.append(self._event(level, f"atlas: {what} at step {step}",
                                       decision["predicates"][name]["reason"], f"predicate:{name}", step))
            self.last_verdicts[name] = verdict
        return out

    def _values(self, rule: AlertRule, record: dict[str, Any]) -> list[tuple[str, Any]]:
        if rule.scope == "summary":
            return [("summary", record.get(rule.metric))]
        layers = record.get("layers", [])
        if rule.scope == "any_protected_layer":
            layers = [lay for lay in layers if lay.get("protected")]
        return [(lay.get("name", "?"), lay.get(rule.metric)) for lay in layers]

    def _rule_events(self, record: dict[str, Any], step: int) -> list[AlertEvent]:
        out = []
        for rule in self.cfg.rules:
            values = [(w, v) for w, v in self._values(rule, record) if isinstance(v, (int, float))]
            hits = [(w, v) for w, v in values if _OPS[rule.op](v, rule.value)]
            fired = bool(values) and (len(hits) == len(values) if rule.scope == "all_layers" else bool(hits))
            last = self.last_fired.get(rule.name)
            if not fired or (last is not None and step - last < rule.min_interval_steps):
                continue
            self.last_fired[rule.name] = step
            where = ", ".join(f"{w}={v:g}" for w, v in hits[:5])
            out.append(self._event(rule.level, f"atlas: {rule.name}", f"Rule '{rule.name}' fired at step {step}: {where}",
                                   f"rule:{rule.name}", step))
        return out

    def failure(self, step: int, error: str, layers: list[str]) -> AlertEvent:
        """A gate that could not run: an ERROR event carrying the failed state, counted with the gates that failed
        before it in a row. The stage is left as it is (the policy did not read this gate).

        >>> engine = AlertEngine()
        >>> [engine.failure(s, "RouterLogitsError: NaN", ["l1"]).failed["count"] for s in (60, 70)]
        [1, 2]
        >>> [(e.level, e.title, e.failed["first_step"]) for e in engine.evaluate({"step": 80, "stage": "clean"}, {})]
        [('INFO', 'atlas: gates run again at step 80 after 2 failed', 60)]
        """
        state = self.failing or {"count": 0, "first_step": int(step), "layers": []}
        state = {**state, "count": state["count"] + 1, "last_step": int(step), "error": error,
                 "layers": [*state["layers"], *(name for name in layers if name not in state["layers"])]}
        self.failing = state
        where = f" in {', '.join(state['layers'])}" if state["layers"] else ""
        return AlertEvent(
            _title(f"atlas: gate failed at step {step}"),
            f"The gate at step {step} could not run{where}: {error}. {state['count']} gate(s) failed in a row since "
            f"step {state['first_step']}; the stage stays {self.last_stage} (the policy's state is kept) until a gate "
            "runs.", "ERROR", "gate_failed", int(step), self.cfg.wait_duration_s, failed=copy.deepcopy(state))

    def _cleared(self, step: int) -> list[AlertEvent]:
        """The failed state ends at the first gate that runs again: one INFO event naming the failed gates."""
        if self.failing is None:
            return []
        state, self.failing = {**self.failing, "cleared_step": step}, None
        return [AlertEvent(
            _title(f"atlas: gates run again at step {step} after {state['count']} failed"),
            f"{state['count']} gate(s) could not run (steps {state['first_step']}..{state['last_step']}; last error: "
            f"{state['error']}); the gate at step {step} ran and clears the failed state.",
            "INFO", "gate_failed_cleared", step, self.cfg.wait_duration_s, failed=state)]

    def evaluate(self, decision: dict[str, Any], record: dict[str, Any]) -> list[AlertEvent]:
        """Alerts for one gate, in order: the end of a failed state, stage events, then threshold rules. The
        occupancy alerts (``revoked``, ``intervene``, ``collapse``, threshold rules) name the dead and overloaded
        experts of each layer."""
        step = int(decision["step"])
        events = (self._cleared(step) + self._stage_events(decision, record) + self._predicate_events(decision, step)
                  + self._rule_events(record, step))
        self.last_stage = decision.get("stage")
        named = expert_lines(record.get("layers", []))
        for event in events:
            if named and (event.key in NAMES_EXPERTS or event.key.startswith("rule:")):
                event.text = f"{event.text} Experts: {' '.join(named)}".strip()
        return events
