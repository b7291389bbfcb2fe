"""The local record as a sink: ``gates.jsonl`` and ``alerts.jsonl``, written before any tracker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from atlas_tracking.artifacts.history import append_line, key, read_history
from atlas_tracking.artifacts.io import write_atomic
from atlas_tracking.artifacts.run_dir import RunDir
from atlas_tracking.schema.artifacts import ALERTS, BACKLOG, DELIVERED


class JsonlSink:
    """The local record: one JSON line per gate, appended with one write and fsynced before any tracker call.

    Alerts go to ``alerts.jsonl`` and tracker acknowledgements to ``delivered.jsonl`` beside it.
    """

    name = "jsonl"

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def records(self) -> list[dict[str, Any]]:
        """The history in the file (see :func:`atlas_tracking.artifacts.history.read_history`)."""
        return read_history(self.path) if self.path.exists() else []

    def log_gate(self, record: dict[str, Any], metrics: dict[str, float], step: int) -> None:
        append_line(self.path, record)

    def alert(self, event: dict[str, Any]) -> None:
        append_line(self.path.with_name(ALERTS), event)

    def acknowledge(self, sink: str, run: str, record: dict[str, Any]) -> None:
        """Note that tracker run ``run`` of ``sink`` holds this gate and its alerts."""
        step, branch = key(record)
        append_line(self.path.with_name(DELIVERED), {"step": step, "branch": branch, "sink": sink, "run": run})

    def delivered(self, sink: str, run: str) -> set[tuple[int, str | None]]:
        return RunDir(self.path.parent).delivered_keys(sink, run)

    def note_backlog(self, backlog: dict[str, list[tuple[int, str | None]]], runs: dict[str, str | None]) -> None:
        """Write ``backlog.json``: per sink, its tracker run (None when unknown) and the gates it had not received
        when training ended (an empty file of sinks when every gate was delivered)."""
        sinks = {name: {"run": runs.get(name), "steps": [[step, branch] for step, branch in gates]}
                 for name, gates in backlog.items() if gates}
        write_atomic(self.path.with_name(BACKLOG), json.dumps({"sinks": sinks}, indent=1, allow_nan=False) + "\n")

    def finish(self) -> None:
        return None
