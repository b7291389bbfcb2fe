"""Gates whose reference is not on disk: a record must never name a baseline that was not written.

A gate names its baseline (``baseline_path``); retention may remove it later, and says so in the gate that pruned it
(:func:`~atlas_tracking.artifacts.retention.pruned_note`). Any other absent baseline is a reference missing from
the record's story (a write that failed before gates committed only once written, or a folder removed by hand):
``atlas-tracking gates``, ``verify``, ``report`` and ``du`` name each such gate.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from atlas_tracking.artifacts.history import append_line
    >>> run = Path(tempfile.mkdtemp())
    >>> append_line(run / "gates.jsonl", {"step": 0, "baseline_path": str(run / "baselines" / "step_00000000.a")})
    >>> [(m["step"], Path(m["baseline_path"]).name) for m in missing_references(run)]
    [(0, 'step_00000000.a')]
    >>> print(missing_lines(missing_references(run))[0].split(" (")[0])
    reference missing: the gate at step 0 names step_00000000.a, which is not on disk
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from atlas_tracking.artifacts.history import gates_file, monotone, read_lines
from atlas_tracking.artifacts.retention import pruned_note


def missing_reference(record: dict[str, Any], run_dir: Path) -> str | None:
    """The baseline ``record`` names when it is not on disk and retention did not remove it, else None."""
    path = record.get("baseline_path")
    if not path:
        return None
    folder = Path(path) if Path(path).is_absolute() else run_dir / path
    if folder.is_dir() or (run_dir / "baselines" / folder.name).is_dir() or pruned_note(run_dir / "baselines" / folder.name):
        return None
    return str(path)


def missing_references(run: str | Path) -> list[dict[str, Any]]:
    """Every gate of a run's history (a run directory, Lightning root or gates file) whose reference is missing (read
    without a word about a torn last line: the command's own reading of the history says it once)."""
    file = gates_file(run)
    return [{"step": rec["step"], "baseline_path": path} for rec in monotone(read_lines(file))[0]
            if (path := missing_reference(rec, file.parent)) is not None]


def missing_lines(missing: list[dict[str, Any]]) -> list[str]:
    """What a command prints for each gate whose reference is missing."""
    return [f"reference missing: the gate at step {m['step']} names {Path(m['baseline_path']).name}, which is not on "
            f"disk ({m['baseline_path']}) and which no retention removed: the record names a reference it does not "
            "hold" for m in missing]
