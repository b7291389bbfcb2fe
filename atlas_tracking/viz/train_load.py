"""The training-batch load between gates as the report and ``atlas-tracking gates`` show it (docs/telemetry.md).

:func:`load_view` reads a run's ``load.jsonl`` intervals beside its gate records into one plain object: how many
intervals and which steps they cover, the last interval's bounded summary
(:func:`~atlas_tracking.artifacts.load_summary.summarize`) with its worst layer's name, every alert an interval
raised (the alarm, WARN, and its clearing, INFO) with the layers in breach at that interval, and the early gates
(records whose ``trigger`` is ``telemetry``: the gates an alarm asked for) with what they read (status, stage).
:func:`format_load` prints it.

Example:
    >>> lines = [
    ...     {"step": 2, "first_step": 1, "tokens": 8, "layers": [{"layer": 1, "name": "l1", "load": [4, 4, 4, 4]}]},
    ...     {"step": 4, "first_step": 3, "tokens": 8, "layers": [{"layer": 1, "name": "l1", "load": [16, 0, 0, 0]}],
    ...      "breach": [{"layer": 1, "name": "l1"}], "alarm": True,
    ...      "alerts": [{"level": "WARN", "title": "alarm at step 4", "text": "l1 collapsed", "key": "k", "step": 4}]}]
    >>> gates = [{"step": 0, "trigger": "start"}, {"step": 4, "trigger": "telemetry", "trigger_reason": "l1 collapsed",
    ...           "status": "RED", "stage": "collapse"}]
    >>> print("\\n".join(format_load(load_view(lines, gates))))
    training-batch load between gates: 2 interval(s), steps 1-4
      last interval (steps 3-4): worst layer 1 (l1): load CV 1.732, max/mean 4.000, dead fraction max 0.750, min normalised entropy 0.000
      alarms raised: 1
        step 4 WARN: alarm at step 4 (layers in breach: 1)
      early gates (trigger telemetry): 1
        step 4 RED collapse: l1 collapsed
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from atlas_tracking.artifacts.load_summary import summarize, worst_row
from atlas_tracking.schema.load import COUNTED_NO_GRAD_PASSES

EARLY_TRIGGER = "telemetry"
"""The ``trigger`` of a gate record that the training-batch alarm asked for (an early gate)."""

SUMMARY_TEXT = (("load_cv_max", "load CV"), ("max_over_mean", "max/mean"), ("dead_fraction_max", "dead fraction max"),
                ("entropy_min", "min normalised entropy"), ("dropped_fraction", "dropped fraction"),
                ("overload_factor", "overload factor"))
"""The summary fields :func:`format_load` prints for the last interval, and their words (the two last only where the
line has them: a capacity limit, expert parallelism)."""

REASON_CHARS = 160
"""How much of an early gate's ``trigger_reason`` the text shows (``--json`` has all of it)."""


def raised(line: dict[str, Any]) -> bool:
    """Whether an interval raised the alarm (an alert above INFO; the alarm's clearing is INFO).

    >>> raised({"alerts": [{"level": "WARN"}]}), raised({"alerts": [{"level": "INFO"}]}), raised({})
    (True, False, False)
    """
    return any(a.get("level") != "INFO" for a in line.get("alerts") or [])


def is_early(gate: dict[str, Any]) -> bool:
    """Whether a gate record is an early gate (its ``trigger`` is :data:`EARLY_TRIGGER`)."""
    return gate.get("trigger") == EARLY_TRIGGER


def last_summary(line: dict[str, Any]) -> dict[str, Any]:
    """The bounded summary of one interval, its steps and the name of its worst layer (None without routes)."""
    worst = worst_row(line)
    summary = summarize(line)
    return {"first_step": line.get("first_step"), "step": line["step"],
            "worst_layer_name": None if worst is None else worst["name"], **summary}


def load_view(lines: Sequence[dict[str, Any]], gates: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """What the report and ``atlas-tracking gates`` say of a run's intervals (None for a run without any)."""
    if not lines:
        return None
    alerts = [{"step": line["step"], "level": a.get("level"), "key": a.get("key"), "title": a.get("title"),
               "text": a.get("text"), "layers": [b["layer"] for b in line.get("breach") or []]}
              for line in lines for a in line.get("alerts") or []]
    return {
        "intervals": len(lines), "first_step": lines[0].get("first_step", lines[0]["step"]),
        "last_step": lines[-1]["step"], "last": last_summary(lines[-1]), "alerts": alerts,
        "early_gates": [{"step": g["step"], "status": g.get("status"), "stage": g.get("stage"),
                         "trigger_reason": g.get("trigger_reason")} for g in gates if is_early(g)],
        "uncounted": [line["uncounted"] for line in lines if line.get("uncounted")],
        "counted_no_grad": [[line.get("first_step", line["step"]), line["step"]] for line in lines
                            if line.get("schema_version") == COUNTED_NO_GRAD_PASSES],
    }


def no_grad_note(view: dict[str, Any]) -> str | None:
    """What the report and ``atlas-tracking gates`` say of intervals written by version 1 of ``load.jsonl``, which
    also counted training-mode passes without gradients (None when there are none)."""
    spans = view["counted_no_grad"]
    if not spans:
        return None
    return (f"{len(spans)} interval(s) of steps {spans[0][0]}-{spans[-1][1]} were written by load.jsonl version "
            f"{COUNTED_NO_GRAD_PASSES}, which also counted training-mode passes without gradients (a log-probability "
            "pass, a generation under no_grad); later versions count training forwards only "
            "(docs/telemetry.md#what-is-counted)")


def _num(value: float) -> str:
    return f"{value:.3f}" if abs(value) >= 0.1 or value == 0 else f"{value:.3g}"


def format_load(view: dict[str, Any]) -> list[str]:
    """The lines ``atlas-tracking gates`` prints after the gate table for :func:`load_view`'s answer."""
    last = view["last"]
    out = [f"training-batch load between gates: {view['intervals']} interval(s), steps "
           f"{view['first_step']}-{view['last_step']}"]
    where = f"last interval (steps {last['first_step']}-{last['step']})"
    if last.get("worst_layer") is None:
        out.append(f"  {where}: no route counted")
    else:
        numbers = ", ".join(f"{words} {_num(last[key])}" for key, words in SUMMARY_TEXT if last.get(key) is not None)
        out.append(f"  {where}: worst layer {last['worst_layer']} ({last['worst_layer_name']}): {numbers}")
    for first, end in view["uncounted"]:
        out.append(f"  steps {first}-{end}: no interval holds their routes (counted by processes gone before a resume)")
    if (note := no_grad_note(view)) is not None:
        out.append(f"  {note}")
    cleared = sum(1 for a in view["alerts"] if a["level"] == "INFO")
    out.append(f"  alarms raised: {len(view['alerts']) - cleared}" + (f", cleared: {cleared}" if cleared else ""))
    for a in view["alerts"]:
        layers = f" (layers in breach: {', '.join(map(str, a['layers']))})" if a["layers"] else ""
        out.append(f"    step {a['step']} {a['level']}: {a['title']}{layers}")
    out.append(f"  early gates (trigger {EARLY_TRIGGER}): {len(view['early_gates'])}")
    for g in view["early_gates"]:
        reason = str(g["trigger_reason"] or "-")
        out.append(f"    step {g['step']} {g['status']} {g['stage']}: "
                   + (reason if len(reason) <= REASON_CHARS else reason[: REASON_CHARS - 1] + "…"))
    return out
