"""A run's gates for the terminal: the last gate's verdict, where and what to do first
(:func:`~atlas_tracking.viz.first_screen.first_lines`), then one row per gate, what the gates cost
(:func:`gate_cost`), the training-batch load between them, the failed gates, and what each tracker still lacks.

:func:`gate_table` is the table (``ref`` is the step the deltas are against: the baseline, or the
previous gate in pretraining); :func:`run_gates` reads a run directory into the rows, the intervals of
``load.jsonl`` (:func:`~atlas_tracking.viz.train_load.load_view`; None without the file), the failed
gates of ``errors.jsonl`` and the backlog of each tracker (the history's gates that ``delivered.jsonl``
does not note for the sink's latest tracker run); :func:`format_run_gates` prints it, as
``atlas-tracking gates RUN_DIR`` does (docs/cli.md).

Example:
    >>> import tempfile
    >>> from atlas_tracking.artifacts.history import append_line
    >>> d = Path(tempfile.mkdtemp())
    >>> for step in (0, 10):
    ...     append_line(d / "gates.jsonl", {"step": step, "branch": "a", "c2": 0.05, "status": "GREEN",
    ...                                     "stage": "clean", "phase": "post_training"})
    >>> append_line(d / "delivered.jsonl", {"step": 0, "branch": "a", "sink": "wandb", "run": "r1"})
    >>> append_line(d / "errors.jsonl", {"step": 20, "branch": "a", "error": "RuntimeError: out of memory"})
    >>> print(format_run_gates(run_gates(d)))  # doctest: +NORMALIZE_WHITESPACE
    verdict: GREEN at step 10 (status GREEN, stage clean)
    where: no routed layer recorded
    what to do: nothing asked at this gate
    <BLANKLINE>
    step  loss  c2      dc2  dead  minH  cv  nll  ref  phase          verdict  status  stage  ready  alerts
    ----  ----  ------  ---  ----  ----  --  ---  ---  -------------  -------  ------  -----  -----  ------
    0     -     0.0500  -    -     -     -   -    -    post_training  GREEN    GREEN   clean  -      -
    10    -     0.0500  -    -     -     -   -    -    post_training  GREEN    GREEN   clean  -      -
    failed gates: 1
      step 20: RuntimeError: out of memory
    not yet delivered: wandb (run r1): 1 gate(s), steps 10
    to deliver them, resume the run from a checkpoint: each tracker run is sent the gates delivered.jsonl does not list (docs/trackers.md#catch-up)
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from atlas_tracking.artifacts.history import gates_file, key, read_history, read_lines
from atlas_tracking.artifacts.load_record import read_load
from atlas_tracking.artifacts.record import finite_number
from atlas_tracking.artifacts.run_dir import RunDir
from atlas_tracking.schema.verdict import gate_verdict
from atlas_tracking.viz.first_screen import first_lines
from atlas_tracking.viz.tables import c2_cell, format_table, top1
from atlas_tracking.viz.train_load import format_load, load_view

HEADER = ["step", "loss", "c2", "dc2", "dead", "minH", "cv", "nll", "ref", "phase", "verdict", "status", "stage",
          "ready", "alerts"]
"""The columns of :func:`gate_table`: the key receipts, the phase, the verdict and the part that raised it
(:func:`~atlas_tracking.schema.verdict.gate_verdict`), the receipt-level status, stage, readiness and alert levels."""


def _row(r: dict[str, Any]) -> list[Any]:
    handoff = r.get("handoff")
    return [r["step"], r.get("loss"), c2_cell(r.get("c2"), top1(r)), c2_cell(r.get("c2_delta"), top1(r)),
            r.get("dead_experts"), r.get("min_entropy"),
            r.get("mean_cv"), r.get("canary_nll"), r.get("baseline_step"), r.get("phase"), gate_verdict(r).headline(),
            r.get("status"),
            r.get("stage"), "-" if not handoff else ("yes" if handoff["ready"] else "no"),
            ",".join(a["level"] for a in r.get("alerts", [])) or "-"]


def gate_table(recs: list[dict[str, Any]]) -> str:
    """One row per gate of a history (:data:`HEADER`)."""
    return format_table(HEADER, [_row(r) for r in recs])


def backlog(run: RunDir, history: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per tracker sink named in ``delivered.jsonl``: its latest tracker run and the history's steps it lacks;
    a sink that ``backlog.json`` names and ``delivered.jsonl`` does not (it never received a gate) is listed
    with the steps it lacked when training ended."""
    latest: dict[str, str] = {}
    for line in read_lines(run.delivered):
        if line.get("sink") is not None and line.get("run") is not None:
            latest[line["sink"]] = line["run"]
    out = {}
    for sink, tracker_run in latest.items():
        have = run.delivered_keys(sink, tracker_run)
        out[sink] = {"run": tracker_run, "missing_steps": [r["step"] for r in history if key(r) not in have]}
    for sink, entry in run.waiting().items():
        if sink not in out:
            out[sink] = {"run": entry["run"], "missing_steps": [step for step, _ in entry["steps"]]}
    return out


def gate_cost(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What a history's gates cost: how many recorded their wall time, its sum, and the median and last of their
    shares of the wall time since the gate before in the same process (``gate_share``; None where no gate has one);
    None where no gate recorded its time.

    >>> gate_cost([{"gate_seconds": 2.0}, {"gate_seconds": 1.0, "gate_share": 0.02},
    ...            {"gate_seconds": 1.0, "gate_share": 0.01}])
    {'gates': 3, 'seconds': 4.0, 'share_median': 0.015, 'share_last': 0.01}
    """
    seconds = [finite for r in history if (finite := finite_number(r.get("gate_seconds"))) is not None]
    shares = [finite for r in history if (finite := finite_number(r.get("gate_share"))) is not None]
    if not seconds:
        return None
    return {"gates": len(seconds), "seconds": sum(seconds),
            "share_median": statistics.median(shares) if shares else None, "share_last": shares[-1] if shares else None}


def format_cost(cost: dict[str, Any]) -> str:
    """:func:`gate_cost` as a line.

    >>> format_cost({"gates": 3, "seconds": 4.0, "share_median": 0.015, "share_last": 0.01})
    'gate cost: 3 gates, 4.0 s in all; each gate over the wall time since the one before: median 1.50%, last 1.00%'
    """
    line = f"gate cost: {cost['gates']} gates, {cost['seconds']:.1f} s in all"
    if cost["share_median"] is None:
        return line
    return (line + f"; each gate over the wall time since the one before: median {100 * cost['share_median']:.2f}%, "
            f"last {100 * cost['share_last']:.2f}%")


def run_gates(path: str | Path) -> dict[str, Any]:
    """A run directory (or its gates file) read for the terminal: rows, the training-batch load between gates,
    failed gates and the trackers' backlog."""
    file = gates_file(path)
    run = RunDir(file.parent)
    history = read_history(file)
    failed = [{"step": e["step"], "branch": e.get("branch"), "error": e.get("error")} for e in read_lines(run.errors)]
    return {"gates_file": str(file), "first": first_lines(history[-1]) if history else [], "header": HEADER,
            "rows": [_row(r) for r in history],
            "load": load_view(read_load(file.parent), history), "cost": gate_cost(history), "failed": failed,
            "backlog": backlog(run, history)}


def format_run_gates(summary: dict[str, Any]) -> str:
    """The text ``atlas-tracking gates`` prints for :func:`run_gates`' answer."""
    lines = [*summary["first"], ""] if summary.get("first") else []
    lines.append(format_table(summary["header"], summary["rows"]))
    if summary.get("cost"):
        lines.append(format_cost(summary["cost"]))
    if summary.get("load"):
        lines += format_load(summary["load"])
    if summary["failed"]:
        lines.append(f"failed gates: {len(summary['failed'])}")
        lines += [f"  step {e['step']}: {e['error']}" for e in summary["failed"]]
    for sink, entry in summary["backlog"].items():
        missing = entry["missing_steps"]
        if missing:
            lines.append(f"not yet delivered: {sink} (run {entry['run']}): {len(missing)} gate(s), steps "
                         + ", ".join(map(str, missing)))
        else:
            lines.append(f"delivered: {sink} (run {entry['run']}) holds every gate of the history")
    if any(entry["missing_steps"] for entry in summary["backlog"].values()):
        lines.append("to deliver them, resume the run from a checkpoint: each tracker run is sent the gates "
                     "delivered.jsonl does not list (docs/trackers.md#catch-up)")
    return "\n".join(lines)
