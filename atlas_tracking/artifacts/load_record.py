"""``load.jsonl``: the training-batch routes of every logging interval, one history across resumes.

Each interval is appended as one JSON line with one write and an fsync, before any tracker hears of it
(:func:`~atlas_tracking.artifacts.history.append_line`: a line cut short by a crash is cut off before the next
append and never read as an interval). A line states its ``branch`` (the training segment that wrote it); the
training state keeps the segments of its history, ``[[branch, first step], ...]``, so that a resume from an
older checkpoint moves the intervals written after it to ``load.abandoned.jsonl`` (never deleted) and brings
back those of its own history (:func:`rewind_load`), as the gates' rewind does.

Example:
    >>> import tempfile
    >>> from atlas_tracking.artifacts.history import append_line
    >>> run = Path(tempfile.mkdtemp())
    >>> for step, branch in [(50, "a"), (100, "a"), (150, "a"), (150, "b")]:
    ...     append_line(run / LOAD, {"step": step, "branch": branch, "layers": []})
    >>> rewind_load(run, 150, [["a", 0], ["b", 101]])      # resumed at 100 on branch b, now restored at 150
    1
    >>> [(x["step"], x["branch"]) for x in read_load(run)]
    [(50, 'a'), (100, 'a'), (150, 'b')]
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from atlas_tracking.artifacts.history import (
    HistoryError,
    read_lines,
    read_lines_and_torn,
    torn_note,
    write_lines,
)
from atlas_tracking.schema.artifacts import LOAD, LOAD_ABANDONED
from atlas_tracking.schema.load import LOAD_SCHEMA_VERSION
from atlas_tracking.schema.record import version_refused

log = logging.getLogger("atlas_tracking")

Segments = Sequence[Sequence[Any]]
"""``[[branch, first step], ...]``: the training segments of a history, in order."""


def series_file(path: str | Path, name: str) -> Path:
    """The file ``name`` of a run directory, of a Lightning root (``<root>/atlas``), or ``path`` itself when it is
    a file (which may not exist yet)."""
    path = Path(path)
    if path.is_dir():
        nested = path / "atlas" / name
        return nested if not (path / name).exists() and nested.exists() else path / name
    return path


def read_series(file: Path, kind: str, lost: str, newest: int) -> list[dict[str, Any]]:
    """Every complete line of ``file``, in order; a last line cut short by a crash is left out with one warning
    naming it as a ``kind`` whose ``lost`` figures the next append removes. A line of a ``schema_version`` newer than
    ``newest`` (written by a later atlas_tracking) is a :class:`~atlas_tracking.artifacts.history.HistoryError`."""
    lines, torn = read_lines_and_torn(file)
    if torn:
        log.warning(torn_note(file, torn, kind, f"the next append removes it; its {lost} are lost"))
    for line in lines:
        if (refused := version_refused(line.get("schema_version", newest), newest)) is not None:
            raise HistoryError(f"{file}: the {kind} at step {line.get('step')} {refused}")
    return lines


def load_file(path: str | Path) -> Path:
    """The load file of a run directory, of a Lightning root (``<root>/atlas``) or the file itself (which may not
    exist yet: a run without telemetry has none)."""
    return series_file(path, LOAD)


def read_load(path: str | Path) -> list[dict[str, Any]]:
    """Every complete interval, in file order; a last line cut short by a crash is left out with one warning."""
    return read_series(load_file(path), "interval", "routes", LOAD_SCHEMA_VERSION)


def in_history(line: dict[str, Any], segments: Segments, step: int) -> bool:
    """Whether an interval belongs to the history of a training state restored at ``step`` whose segments are
    ``segments``: written by a segment's branch within its steps (the last one up to ``step``).

    >>> segs = [["a", 0], ["b", 101]]
    >>> in_history({"step": 100, "branch": "a"}, segs, 200), in_history({"step": 150, "branch": "a"}, segs, 200)
    (True, False)
    """
    at = int(line["step"])
    for i, (branch, first) in enumerate(segments):
        end = int(segments[i + 1][1]) - 1 if i + 1 < len(segments) else step
        if line.get("branch") == branch and int(first) <= at <= end:
            return True
    return False


def rewind_load(run_dir: str | Path, step: int, segments: Segments | None) -> int:
    """Make ``load.jsonl`` the history of a training state restored at ``step``; returns the intervals moved
    (:func:`rewind_series`)."""
    return rewind_series(Path(run_dir) / LOAD, Path(run_dir) / LOAD_ABANDONED, step, segments)


def rewind_series(live_file: Path, parked_file: Path, step: int, segments: Segments | None) -> int:
    """Make ``live_file`` (one line per step, each naming its ``branch``) the history of a training state restored
    at ``step``, the other lines in ``parked_file``; returns the lines moved.

    With ``segments`` None (a state saved without them) the lines after ``step`` move aside and those already
    aside stay there (no branch says which of them would belong to the history). Files are
    replaced in an order where a crash leaves every line in at least one of them."""
    live, parked = read_lines(live_file), read_lines(parked_file)
    if not live and not parked:
        return 0
    every: dict[tuple[int, Any], dict[str, Any]] = {}
    for line in parked + live:
        every.setdefault((int(line["step"]), line.get("branch")), line)
    cut = {(int(x["step"]), x.get("branch")) for x in live if int(x["step"]) <= step}

    def keep(line: dict[str, Any]) -> bool:
        if segments is None:
            return (int(line["step"]), line.get("branch")) in cut
        return in_history(line, segments, step)

    history = sorted((x for x in every.values() if keep(x)), key=lambda x: int(x["step"]))
    rest = [x for x in every.values() if not keep(x)]
    moved = sum(1 for x in live if not keep(x)) + sum(1 for x in history if x not in live)
    if moved == 0 and len(parked) == len(rest):
        return 0
    write_lines(parked_file, list(every.values()))  # a superset first: nothing can be lost
    write_lines(live_file, history)
    write_lines(parked_file, rest)
    return moved
