"""A run's history: crash-safe JSON lines, and the one reader of a run's gates.

Every gate record carries ``step`` (the training step), ``branch`` (the training segment that
wrote it: a new one each time training starts or resumes) and ``run_id`` (the run, constant
across resumes). The history is the chain of gates the current training state descends from:
steps strictly increase and nothing of another branch is mixed in. When training resumes from
an older checkpoint, the gates written after it by the branch that is left behind are moved to
``gates.abandoned.jsonl`` (never deleted) and their receipts files follow; a later resume from
that branch's own checkpoint moves them back.

:func:`read_history` is the one reader: the report, ``replay``, the trackers' catch-up and any
other consumer read the record through it. Lines are appended with one write and an fsync; a
line torn by a crash (no trailing newline) is never read as a gate and is cut off before the
next append.

Example (a file written before branches were kept apart, resolved as a resume resolves it now):
    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "gates.jsonl"
    >>> for step, branch in [(0, "a"), (10, "a"), (20, "a"), (20, "b"), (30, "b")]:
    ...     append_line(path, {"step": step, "branch": branch})
    >>> [(r["step"], r["branch"]) for r in read_history(path)]
    [(0, 'a'), (10, 'a'), (20, 'b'), (30, 'b')]
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from atlas_tracking.artifacts.io import named_error, write_all, write_atomic
from atlas_tracking.schema.artifacts import GATES
from atlas_tracking.schema.record import GateRecord, RecordVersionError, upgrade_record

log = logging.getLogger("atlas_tracking")


class HistoryError(ValueError):
    """A record file holds a line that is not a gate (bad JSON in the middle, no integer step)."""


def new_id() -> str:
    """A fresh run or branch identifier (12 hex characters)."""
    return uuid.uuid4().hex[:12]


def key(record: dict[str, Any]) -> tuple[int, str | None]:
    """A gate's identity: (step, branch)."""
    return int(record["step"]), record.get("branch")


def identity(record: dict[str, Any]) -> tuple:
    """A gate's identity in a rewind: (step, branch); a record written before branches, by its content."""
    if record.get("branch") is not None:
        return key(record)
    return int(record["step"]), None, json.dumps(record, sort_keys=True)


# --- lines: append, repair, read, rewrite --------------------------------------------------------


def cut_torn_tail(fd: int, path: Path) -> None:
    """Truncate a last line that has no newline (a write cut short by a crash)."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    end, keep = size, 0
    while end > 0:
        start = max(0, end - 65536)
        chunk = os.pread(fd, end - start, start)
        nl = chunk.rfind(b"\n")
        if nl >= 0:
            keep = start + nl + 1
            break
        end = start
    os.ftruncate(fd, keep)
    log.warning("atlas: %s ended in a line cut short by a crash (%d bytes); it was never a complete record "
                "and was removed", path, size - keep)


def append_line(path: str | Path, obj: dict[str, Any]) -> None:
    """Append one JSON object as one line, then fsync: the line is complete on disk when this returns.

    A write that fails (a full disk) takes back what it wrote of the line before it raises, so it leaves no
    line cut short behind it; the ``OSError`` names the file and, on a full disk, the free space there."""
    path = Path(path)
    data = (json.dumps(obj, allow_nan=False, separators=(",", ":")) + "\n").encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as exc:
        raise named_error(exc, path) from exc
    try:
        cut_torn_tail(fd, path)
        size = os.fstat(fd).st_size
        try:
            write_all(fd, data)
            os.fsync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):  # no space is needed to take the cut line back
                os.ftruncate(fd, size)
            raise named_error(exc, path) from exc
    finally:
        os.close(fd)


def write_lines(path: str | Path, objs: Iterable[dict[str, Any]]) -> None:
    """Replace a JSON-lines file atomically (temporary file, fsync, rename)."""
    write_atomic(Path(path), "".join(json.dumps(o, allow_nan=False, separators=(",", ":")) + "\n" for o in objs))


def read_lines(path: str | Path, check: Callable[[dict[str, Any]], Any] | None = None) -> list[dict[str, Any]]:
    """Every complete line of a JSON-lines file, in file order (a torn last line is skipped).

    A line that is not a JSON object, lacks an integer ``step`` or fails ``check`` is a
    :class:`HistoryError` naming the file and line number.
    """
    return read_lines_and_torn(path, check)[0]


REBUILT_FROM_RECEIPTS = "the next resume rebuilds it from its receipts file, or removes it"
"""What happens to a gate line cut short by a crash."""


def torn_note(path: Path, torn: str, kind: str = "gate", fate: str = REBUILT_FROM_RECEIPTS) -> str:
    """The one line a reader says about a last line it dropped (cut short by a crash).

    >>> torn_note(Path("atlas/gates.jsonl"), '{"schema_version":3,"step":40,"c2":0.0')
    'atlas: atlas/gates.jsonl ends in a line cut short by a crash (38 bytes, step 40); it is not read as a gate (the next resume rebuilds it from its receipts file, or removes it)'
    """
    found = re.search(r'"step":\s*(\d+)', torn)
    where = f", step {found.group(1)}" if found else ""
    return (f"atlas: {path} ends in a line cut short by a crash ({len(torn.encode())} bytes{where}); "
            f"it is not read as a {kind} ({fate})")


def read_lines_and_torn(path: str | Path, check: Callable[[dict[str, Any]], Any] | None = None
                        ) -> tuple[list[dict[str, Any]], str]:
    """:func:`read_lines`, and the text of a torn last line it dropped ("" when there is none)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return [], ""
    except OSError as exc:
        raise HistoryError(f"cannot read {path}: {exc.strerror}") from None
    lines = text.split("\n")
    torn = lines.pop()  # "" when the file ends with a newline
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise HistoryError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise HistoryError(f"{path}:{number}: a gate must be a JSON object")
        step = rec.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise HistoryError(f"{path}:{number}: field 'step' must be an integer, got {step!r}")
        if check is not None:
            try:
                check(rec)
            except ValueError as exc:
                raise HistoryError(f"{path}:{number}: {exc}") from None
        out.append(rec)
    if torn.strip():
        try:
            rec = json.loads(torn)
        except json.JSONDecodeError:
            rec = None
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and not isinstance(rec["step"], bool):
            if check is not None:
                try:
                    check(rec)
                except ValueError as exc:
                    raise HistoryError(f"{path}:{len(lines) + 1}: {exc}") from None
            out.append(rec)  # a complete object whose newline is missing (hand-written file)
            torn = ""
    return out, torn.strip()


def monotone(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split records in file order into (history, superseded): a record whose step does not exceed the
    last kept one starts a newer branch there, superseding the kept records at or after its step."""
    kept: list[dict[str, Any]] = []
    superseded: list[dict[str, Any]] = []
    for rec in records:
        while kept and kept[-1]["step"] >= rec["step"]:
            superseded.append(kept.pop())
        kept.append(rec)
    return kept, superseded


def gates_file(path: str | Path) -> Path:
    """The gates file of a run directory, a Lightning root (``<root>/atlas``) or the file itself."""
    path = Path(path)
    if path.is_dir():
        for candidate in (path / GATES, path / "atlas" / GATES):
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(f"no {GATES} under {path}")
    if not path.exists():
        raise FileNotFoundError(f"no such gates file or run directory: {path}")
    return path


def read_history(path: str | Path, check: Callable[[dict[str, Any]], Any] | None = None) -> list[GateRecord]:
    """The run's history: its gates in strictly increasing step, one lineage, nothing abandoned.

    ``path`` is a run directory, a Lightning root (``<root>/atlas/gates.jsonl``) or a gates file.
    A file written before branches were kept apart (a resume appended a second branch after the
    first) is resolved the same way a resume does it now: a gate whose step does not exceed the
    previous one starts the newer branch, which supersedes the older branch from that step on.
    Records of an older schema version are read as this version reads them
    (:func:`~atlas_tracking.schema.record.upgrade_record`); a newer one is a :class:`HistoryError`.
    A last line cut short by a crash is dropped with one warning that says so (:func:`torn_note`).
    """
    file = gates_file(path)
    lines, torn = read_lines_and_torn(file, check)
    if torn:
        log.warning(torn_note(file, torn))
    history, _ = monotone(lines)
    try:
        return [upgrade_record(rec) for rec in history]  # type: ignore[misc]
    except RecordVersionError as exc:
        raise HistoryError(f"{file}: {exc}") from None


def read_run_gates(path: str | Path) -> tuple[list[dict[str, Any]], Path]:
    """A run's history (:func:`read_history`) and its gates file, for the commands that read a finished
    run. Raises :class:`HistoryError` (or ``OSError`` for a missing record) when it cannot be read or
    holds no gates."""
    file = gates_file(path)
    records = read_history(file)
    if not records:
        raise HistoryError(f"{file} holds no gates")
    return records, file


# --- the run directory ---------------------------------------------------------------------------






