"""``atlas-tracking replay gates.jsonl``: the gate policy over a recorded sequence, JSON lines out.

Every input line is a gate (the first is the baseline) with at least ``step, c2, dead_experts,
min_entropy, mean_cv, loss`` (loss may be null; c2 may be null with ``c2_absent``, at top-1 routing);
optional ``margin, resume, num_experts, layers, c2_delta_ci``, and ``loss_key, objective_direction`` (how the loss
improves: ``minimize``, the default, or ``maximize``): each gate's loss is read in its record's own direction, so a
run's record replays to the decisions it made live. ``atlas/gates.jsonl`` written by a run is valid input. All lines are
read and validated before anything is printed: a bad line is one error naming the line
number and the field, and nothing is half-written. A run's record is replayed as its one
history (gates of an abandoned branch are not replayed).

Example:
    >>> out = replay([{"step": 0, "c2": 0.08, "dead_experts": 42, "min_entropy": 3.0, "mean_cv": 140, "loss": None},
    ...               {"step": 500, "c2": -0.03, "dead_experts": 285, "min_entropy": 2.3, "mean_cv": 190, "loss": 4.7}])
    >>> [(o["status"], o["stage"]) for o in out]
    [('BASELINE', 'baseline'), ('YELLOW', 'revoked')]
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from atlas_tracking.artifacts.history import HistoryError, read_history
from atlas_tracking.decisions.alerts import AlertEngine
from atlas_tracking.decisions.policy import GatePolicy, GateSummary
from atlas_tracking.schema.config import AtlasConfig

OUTPUT_KEYS = ("step", "status", "stage", "action", "interpretation", "licensed", "unlicensed", "intervention", "alerts")


class ReplayError(ValueError):
    """A gates file line is not valid JSON or lacks a required field."""


def replay(records: Iterable[dict[str, Any]], config: AtlasConfig | None = None) -> list[dict[str, Any]]:
    """Decisions (with alerts) for a sequence of gate records, in order."""
    cfg = config or AtlasConfig()
    policy, engine = GatePolicy(cfg), AlertEngine(cfg.alerts, cfg.lifecycle)
    out = []
    for record in records:
        decision = policy.read(GateSummary.from_dict(record)).to_dict()
        decision["alerts"] = [e.to_dict() for e in engine.evaluate(decision, record)]
        out.append({**{k: decision[k] for k in OUTPUT_KEYS}, **decision})
    return out


def read_gates(path: str | Path) -> list[dict[str, Any]]:
    """The run's history (:func:`~atlas_tracking.artifacts.history.read_history`), every line validated first;
    errors name the line number and field."""
    try:
        records = read_history(path, check=GateSummary.from_dict)
    except (HistoryError, OSError) as exc:
        raise ReplayError(str(exc)) from None
    if not records:
        raise ReplayError(f"{path}: no gates (the first line must be the baseline)")
    return records




