"""``rollout.jsonl``: the rollout agreement of every recorded training step, one history across resumes.

Each recorded step is appended as one JSON line with one write and an fsync, before any tracker hears of it (a
line cut short by a crash is cut off before the next append and never read as a step), and names its ``branch``:
a resume from an older checkpoint moves the steps written after it to ``rollout.abandoned.jsonl`` (never deleted)
and brings back those of its own history, as the load record does
(:func:`~atlas_tracking.artifacts.load_record.rewind_series`).

Example:
    >>> import tempfile
    >>> from atlas_tracking.artifacts.history import append_line
    >>> run = Path(tempfile.mkdtemp())
    >>> for step, branch in [(1, "a"), (2, "a"), (3, "a"), (3, "b")]:
    ...     append_line(run / ROLLOUT, {"step": step, "branch": branch, "layers": []})
    >>> rewind_rollout(run, 3, [["a", 0], ["b", 3]])      # resumed at 2 on branch b, now restored at 3
    1
    >>> [(x["step"], x["branch"]) for x in read_rollout(run)]
    [(1, 'a'), (2, 'a'), (3, 'b')]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from atlas_tracking.artifacts.load_record import Segments, read_series, rewind_series, series_file
from atlas_tracking.schema.artifacts import ROLLOUT, ROLLOUT_ABANDONED
from atlas_tracking.schema.rollout import ROLLOUT_SCHEMA_VERSION


def read_rollout(path: str | Path) -> list[dict[str, Any]]:
    """Every complete recorded step of a run directory (a Lightning root, or the file), in file order; a last line
    cut short by a crash is left out with a warning."""
    return read_series(series_file(path, ROLLOUT), "rollout step", "figures", ROLLOUT_SCHEMA_VERSION)


def rewind_rollout(run_dir: str | Path, step: int, segments: Segments | None) -> int:
    """Make ``rollout.jsonl`` the history of a training state restored at ``step``; returns the steps moved."""
    return rewind_series(Path(run_dir) / ROLLOUT, Path(run_dir) / ROLLOUT_ABANDONED, step, segments)
