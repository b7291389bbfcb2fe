"""The local record as a sink: ``gates.jsonl`` and ``alerts.jsonl``, written before any tracker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from atlas_tracking.artifacts.history import append_line, key, read_history
from atlas_tracking.artifacts.run_dir import RunDir
from atlas_tracking.schema.artifacts import ALERTS, DELIVERED


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

    def finish(self) -> None:
        return None
