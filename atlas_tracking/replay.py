"""``atlas-tracking replay gates.jsonl``: the gate policy over a recorded sequence, JSON lines out.

Every input line is a gate (the first is the baseline) with at least ``step, c2, dead_experts,
min_entropy, mean_cv, loss`` (loss may be null); optional ``margin, resume, num_experts,
layers, c2_delta_ci``. ``atlas/gates.jsonl`` written by a run is valid input. All lines are
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

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from atlas_tracking.alerts import AlertEngine
from atlas_tracking.config import AtlasConfig
from atlas_tracking.history import HistoryError, read_history
from atlas_tracking.policy import GatePolicy, GateSummary

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
    """The run's history (:func:`~atlas_tracking.history.read_history`), every line validated first;
    errors name the line number and field."""
    try:
        records = read_history(path, check=GateSummary.from_dict)
    except (HistoryError, OSError) as exc:
        raise ReplayError(str(exc)) from None
    if not records:
        raise ReplayError(f"{path}: no gates (the first line must be the baseline)")
    return records


def cmd_replay(args: argparse.Namespace) -> int:
    cfg = AtlasConfig.from_yaml(args.config) if args.config else AtlasConfig()
    lines = [json.dumps(d, allow_nan=False) for d in replay(read_gates(args.gates), cfg)]
    text = "\n".join(lines) + "\n"
    if args.out:
        from atlas_tracking.gate_report import write_atomic

        write_atomic(Path(args.out), text)
    else:
        sys.stdout.write(text)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="run the gate policy over a gates JSONL file (one decision per line out)")
    p.add_argument("gates", help="JSON lines: step, c2, dead_experts, min_entropy, mean_cv, loss (first = baseline)")
    p.add_argument("--config", help="atlas YAML config (policy tolerances, alert rules)")
    p.add_argument("--out", help="write the decisions here instead of stdout")
    p.set_defaults(func=cmd_replay)
