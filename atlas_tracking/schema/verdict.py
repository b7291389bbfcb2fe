"""A gate's one operator-facing verdict: the level every surface shows, and the part of the gate that raised it.

A gate holds four signals an operator could read: the receipt-level ``status`` (Table 11's pattern of C2,
occupancy and the objective), the escalation ``stage`` (Table 13), the three predicates and the alerts the gate
raised. They answer different questions, so they may disagree (a YELLOW status in the ``intervene`` stage).
:func:`gate_verdict` reads all four in one place and returns the most severe level any of them raises, with the
part that raised it; the report's badge and headline, the console line, ``atlas-tracking gates``, the W&B summary
and alerts, the MLflow tags and ``atlas/verdict_code``, and the webhook show that, and nothing else computes a
level. The record keeps ``status`` and ``stage`` under their own names (docs/policy.md#the-verdict).

What each part raises:

- ``status``: RED or YELLOW as it is; GREEN and BASELINE raise nothing.
- ``stage``: ``intervene`` is RED; ``revoked``, ``alert``, ``prepare`` and ``collapse`` are YELLOW.
- ``predicate``: a predicate that fails (protected-atlas rewrite, base-domain damage) is YELLOW.
- ``alert``: an ERROR alert is RED, a WARN alert YELLOW.

A gate that could not run is FAILED. When nothing raises a level, the verdict is the status (GREEN, or BASELINE
at a new reference). Ties go to the first part in that order.

Example:
    >>> v = gate_verdict({"status": "YELLOW", "stage": "intervene", "rule": "Table 13 row 3: two worse gates",
    ...                   "alerts": [{"level": "ERROR", "title": "atlas: intervene at step 12"}]})
    >>> v.level, v.source, v.code, v.headline()
    ('RED', 'stage intervene', 3, 'RED (stage intervene)')
    >>> [p.source for p in v.parts]
    ['status YELLOW', 'stage intervene', 'alert ERROR']
    >>> gate_verdict({"status": "GREEN", "stage": "clean"}).level, gate_verdict({}, failed=True).level
    ('GREEN', 'FAILED')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from atlas_tracking.schema.record import FAILED, VERDICT_CODES, Stage, Status

LEVELS = ("BASELINE", "GREEN", "YELLOW", "RED", FAILED)
"""The verdict's levels; the position is the tracker code ``atlas/verdict_code``."""
LEVEL_CODES = {level: code for code, level in enumerate(LEVELS)}
"""Level -> ``atlas/verdict_code``."""
LEVEL_LEGEND = ", ".join(f"{code} {level}" for level, code in LEVEL_CODES.items())
"""``atlas/verdict_code`` in words (the trackers' legend)."""
_RANK = {"BASELINE": 0, "GREEN": 0, "YELLOW": 1, "RED": 2, FAILED: 3}
STAGE_LEVELS = {"intervene": "RED", "revoked": "YELLOW", "alert": "YELLOW", "prepare": "YELLOW",
                "collapse": "YELLOW"}
"""The stages that raise a level (the others raise none)."""
ALERT_LEVELS_RAISED = {"ERROR": "RED", "WARN": "YELLOW"}
"""Alert level -> verdict level (INFO raises none)."""
PREDICATES_RAISING = ("protected_rewrite", "base_damage")
"""The predicates whose ``fail`` raises YELLOW."""


@dataclass(frozen=True)
class Part:
    """One part of a gate that raises a level: which (``source``), what level, and why in words."""

    level: str
    source: str
    reason: str


@dataclass(frozen=True)
class Verdict:
    """A gate's verdict: its ``level``, the ``source`` that raised it and its ``reason``; ``parts`` lists every
    part that raised a level, in the order status, stage, predicates, alerts."""

    level: str
    source: str
    reason: str
    parts: tuple[Part, ...] = field(default_factory=tuple)

    @property
    def code(self) -> int:
        """The level as ``atlas/verdict_code`` (:data:`LEVEL_LEGEND`)."""
        return LEVEL_CODES[self.level]

    def headline(self) -> str:
        """The level and the part that raised it, as every surface prints it: ``RED (stage intervene)``; the level
        alone when the status raised it (``GREEN``, ``RED``)."""
        return self.level if self.source == f"status {self.level}" else f"{self.level} ({self.source})"

    def to_dict(self) -> dict[str, Any]:
        """Level, code, source and reason (what the webhook and ``atlas-tracking gates --json`` carry)."""
        return {"level": self.level, "code": self.code, "source": self.source, "reason": self.reason}


def _status_reason(record: dict[str, Any]) -> str:
    metric = str(record.get("loss_key") or "loss")  # the trend of the metric itself, not a claim about the objective
    trends = [f"{name} {record[key]}" for name, key in (("C2", "c2_trend"), ("occupancy", "occupancy"),
                                                         (metric, "loss_trend")) if record.get(key)]
    return ", ".join(trends) or "the policy's status"


def raised_parts(record: dict[str, Any]) -> list[Part]:
    """Every part of a gate record that raises a level (:data:`STAGE_LEVELS`, :data:`ALERT_LEVELS_RAISED`,
    :data:`PREDICATES_RAISING`, a RED or YELLOW status), in the order status, stage, predicates, alerts.

    >>> raised_parts({"status": "GREEN", "stage": "clean", "predicates": {"base_damage": {"verdict": "fail",
    ...               "reason": "canary NLL change +0.35 > 0.05"}}})
    [Part(level='YELLOW', source='predicate base_damage', reason='canary NLL change +0.35 > 0.05')]
    """
    parts = []
    status, stage = str(record.get("status")), str(record.get("stage"))
    if status in ("RED", "YELLOW"):
        parts.append(Part(status, f"status {status}", _status_reason(record)))
    if stage in STAGE_LEVELS:
        parts.append(Part(STAGE_LEVELS[stage], f"stage {stage}", str(record.get("rule") or record.get("action") or
                                                                    f"the escalation stage is {stage}")))
    for name in PREDICATES_RAISING:
        entry = (record.get("predicates") or {}).get(name) or {}
        if entry.get("verdict") == "fail":
            parts.append(Part("YELLOW", f"predicate {name}", str(entry.get("reason", "fail"))))
    for alert in record.get("alerts") or []:
        level = ALERT_LEVELS_RAISED.get(alert.get("level"))
        if level is not None:
            parts.append(Part(level, f"alert {alert['level']}", str(alert.get("title", ""))))
    return parts


def gate_verdict(record: dict[str, Any], failed: bool = False, error: str = "") -> Verdict:
    """The verdict of one gate record (module docstring); ``failed``: the latest gate could not run (``error``)."""
    if failed:
        return Verdict(FAILED, "gate failed", error or "the latest gate could not run")
    parts = raised_parts(record)
    if parts:
        top = max(parts, key=lambda p: _RANK[p.level])  # max keeps the first of equals: the order above
        return Verdict(top.level, top.source, top.reason, tuple(parts))
    status = str(record.get("status"))
    if status == "BASELINE":
        return Verdict("BASELINE", "status BASELINE", "a new reference: preservation is untested until the next gate")
    return Verdict("GREEN", f"status {status}", _status_reason(record))


def failed_event_verdict(event: dict[str, Any]) -> Verdict | None:
    """The verdict an alert event sets on its own: FAILED for a gate that could not run (its ``failed`` state),
    None for any other event (the gate's record carries the verdict).

    >>> failed_event_verdict({"failed": {"count": 1, "error": "RouterLogitsError: NaN"}}).headline()
    'FAILED (gate failed)'
    >>> failed_event_verdict({"failed": {"count": 0, "cleared_step": 80}}) is None
    True
    """
    failed = event.get("failed")
    if failed is None or "cleared_step" in failed:
        return None
    return gate_verdict({}, failed=True, error=str(failed.get("error", "")))


def code_legends() -> dict[str, str]:
    """What each coded tracker metric's numbers mean, by key: the verdict, the receipt-level status, the stage and
    the predicates (the trackers' legend, and the docs' tracker-keys table).

    >>> code_legends()["atlas/verdict_code"]
    '0 BASELINE, 1 GREEN, 2 YELLOW, 3 RED, 4 FAILED'
    """
    predicate = ", ".join(f"{code} {v}" for v, code in VERDICT_CODES.items())
    return {"atlas/verdict_code": LEVEL_LEGEND,
            "atlas/status_code": ", ".join(f"{s.code} {s.value}" for s in Status),
            "atlas/stage_code": ", ".join(f"{s.code} {s.value}" for s in Stage),
            **{f"atlas/predicate/{name}": predicate for name in PREDICATES_RAISING}}
