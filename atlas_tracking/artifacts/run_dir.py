"""A run directory: the files of one run's record, its identity, baselines, repair and rewind.

Layout of a run directory (``out_dir``; the Lightning callback's default is
``<default_root_dir>/atlas``)::

    run.json                    the run's identity (run_id); another run never appends here
    gates.jsonl                 the history (one JSON line per gate, fsynced before any tracker call)
    gates.abandoned.jsonl       gates of abandoned branches
    load.jsonl                  the training-batch routes of every logging interval between gates (load.abandoned.jsonl:
                                those of abandoned branches)
    alerts.jsonl                the alerts of the history's gates and of its failed gates
    errors.jsonl                gates that could not run, each with its ERROR alert (errors.abandoned.jsonl
                                after a rewind)
    receipts/step_XXXXXXXX.json receipts of the history's gates (each record holds their sha256; large ones
                                are step_XXXXXXXX.safetensors, docs/record.md#receipts-artifacts)
    receipts/abandoned/         receipts of abandoned gates (and files no record acknowledged)
    baselines/step_XXXXXXXX.B/  the baselines retention keeps, each in its own folder, never overwritten
    baseline                    link to the current baseline
    pins.json                   the steps whose baselines retention keeps (docs/record.md#retention)
    delivered.jsonl             which gates each tracker run has received (the trackers' catch-up)
    backlog.json                the gates each sink had not received when training ended
    canaries/F.npz              the canary of fingerprint F (kept by callbacks whose framework re-creates
                                them from a checkpoint, e.g. the transformers Trainer)

When training resumes from an older checkpoint, the gates written after it by the branch that is left
behind are moved to ``gates.abandoned.jsonl`` (never deleted) and their receipts files follow; a later
resume from that branch's own checkpoint moves them back (:meth:`RunDir.rewind`).

Example:
    >>> import tempfile
    >>> from atlas_tracking.artifacts.history import append_line, read_history
    >>> run = RunDir(tempfile.mkdtemp())
    >>> for step, branch in [(0, "a"), (10, "a"), (20, "a"), (30, "a"), (20, "b"), (30, "b")]:
    ...     append_line(run.gates, {"step": step, "branch": branch})
    >>> [(r["step"], r["branch"]) for r in read_history(run.path)]       # a legacy mixed file, resolved
    [(0, 'a'), (10, 'a'), (20, 'b'), (30, 'b')]
    >>> moved = run.rewind(10, lineage=[[0, "a"], [10, "a"]], branch="a")
    >>> [(r["step"], r["branch"]) for r in read_history(run.path)], moved
    ([(0, 'a'), (10, 'a')], 4)
    >>> sorted((r["step"], r["branch"]) for r in read_lines(run.abandoned))
    [(20, 'a'), (20, 'b'), (30, 'a'), (30, 'b')]
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from atlas_tracking.artifacts.history import (
    HistoryError,
    append_line,
    cut_torn_tail,
    identity,
    key,
    monotone,
    new_id,
    read_lines,
    write_lines,
)
from atlas_tracking.artifacts.io import named_error, replace_durably, sha256_text, write_atomic
from atlas_tracking.artifacts.load_record import rewind_load
from atlas_tracking.artifacts.rebuild import prefix_fields, rebuild_cut_gate
from atlas_tracking.artifacts.receipts_file import FORMS, SUFFIXES
from atlas_tracking.artifacts.rollout_record import rewind_rollout
from atlas_tracking.artifacts.tensor_file import stream_sha256
from atlas_tracking.schema.artifacts import (
    ABANDONED,
    ALERTS,
    BACKLOG,
    DELIVERED,
    ERRORS,
    ERRORS_ABANDONED,
    EVALUATIONS,
    GATES,
    LOAD,
    RECORD_FILES,
    ROLLOUT,
    RUN_FILE,
)

log = logging.getLogger("atlas_tracking")


class RunDirError(RuntimeError):
    """The run directory holds another run's record and ``gate.existing_record`` is ``refuse``."""


def _receipts_name(step: int, suffix: str = ".json") -> str:
    return f"step_{step:08d}{suffix}"


def file_sha256(path: Path) -> str | None:
    """The sha256 of a file's bytes, or None when it cannot be read (a receipts file a record points to)."""
    try:
        with path.open("rb") as fh:
            return stream_sha256(fh)
    except OSError:
        return None


class RunDir:
    """The files of one run's record (see the module docstring for the layout)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    gates = property(lambda self: self.path / GATES)
    abandoned = property(lambda self: self.path / ABANDONED)
    alerts = property(lambda self: self.path / ALERTS)
    errors = property(lambda self: self.path / ERRORS)
    delivered = property(lambda self: self.path / DELIVERED)
    backlog = property(lambda self: self.path / BACKLOG)
    evaluations = property(lambda self: self.path / EVALUATIONS)
    receipts = property(lambda self: self.path / "receipts")
    baselines = property(lambda self: self.path / "baselines")
    current_baseline = property(lambda self: self.path / "baseline")

    def receipts_file(self, step: int, form: str | None = None) -> Path:
        """The receipts artifact of the gate at ``step``: in ``form`` (``json`` or ``safetensors``), else the form
        that exists (``receipts/step_N.json`` when none does)."""
        if form is not None:
            return self.receipts / _receipts_name(step, SUFFIXES[form])
        names = [self.receipts / _receipts_name(step, suffix) for suffix in FORMS]
        return next((path for path in names if path.exists()), names[0])

    def receipts_target(self, step: int, form: str) -> Path:
        """Where the gate at ``step`` writes its receipts in ``form``. A file of the other form at that step (a
        gate written before ``gate.receipts_format`` changed) is parked in ``receipts/abandoned/`` first, as a
        resume parks files no record acknowledges, so that one form per step remains."""
        for other in SUFFIXES:
            path = self.receipts_file(step, other)
            if other != form and path.exists():
                parked = self.receipts / "abandoned"
                parked.mkdir(exist_ok=True)
                sha = (file_sha256(path) or "x")[:12]
                replace_durably(path, parked / f"step_{step:08d}.unacknowledged.{sha}{path.suffix}")
        return self.receipts_file(step, form)

    def canary_file(self, fingerprint: str) -> Path:
        return self.path / "canaries" / f"{fingerprint[:16]}.npz"

    # --- identity ------------------------------------------------------------------------------
    def owner(self) -> tuple[bool, str | None]:
        """(holds a record, run_id of that record); run_id None for a record written before run ids."""
        run_file = self.path / RUN_FILE
        if run_file.is_file():
            try:
                return True, json.loads(run_file.read_text()).get("run_id")
            except (OSError, json.JSONDecodeError):
                pass
        for name in (GATES, ABANDONED, ERRORS):
            try:
                recs = read_lines(self.path / name) if (self.path / name).is_file() else []
            except HistoryError:
                return True, "unreadable"
            if recs:
                return True, recs[-1].get("run_id")
        held = any((self.path / n).exists() for n in ("baseline", "baselines", "receipts"))
        return held, None

    def describe(self) -> str:
        try:
            recs = read_lines(self.gates) if self.gates.is_file() else []
        except HistoryError as exc:
            return str(exc)
        if not recs:
            return "no gates"
        return f"{len(recs)} gate(s), steps {recs[0]['step']}..{recs[-1]['step']}"

    def choose(self, run_id: str, adopt_legacy: bool, existing_record: str) -> Path:
        """The directory run ``run_id`` writes its record to: this one, unless it holds another run's record (one
        without a run id is adopted with ``adopt_legacy``); then with ``existing_record`` ``new_dir`` the first free
        sibling ``<path>-2``, ``-3``, ... (a warning names it), with ``refuse`` a :class:`RunDirError`."""
        first = path = self.path
        n = 1
        while True:
            held, owner = RunDir(path).owner()
            if not held or owner == run_id or (owner is None and adopt_legacy):
                break
            if existing_record == "refuse":
                raise RunDirError(
                    f"{path} holds the record of another run (run {owner or 'without id'}, "
                    f"{RunDir(path).describe()}); choose another out_dir, move that record away, or set "
                    f"gate.existing_record: new_dir to write to a new directory beside it")
            n += 1
            path = first.with_name(f"{first.name}-{n}")
        if path != first:
            message = (f"atlas: {first} holds the record of another run ({RunDir(first).describe()}); "
                       f"this run's record goes to {path} (gate.existing_record: new_dir)")
            warnings.warn(message, UserWarning, stacklevel=5)  # once: not also a log line
        return path

    def write_identity(self, run_id: str, canary_fingerprint: str) -> None:
        run_file = self.path / RUN_FILE
        if run_file.is_file():
            return
        write_atomic(run_file, json.dumps({"run_id": run_id, "created": time.time(),
                                           "canary_fingerprint": canary_fingerprint}))

    # --- baselines ------------------------------------------------------------------------------
    def baseline_dir(self, step: int, branch: str) -> Path:
        return self.baselines / f"step_{step:08d}.{branch}"

    def point_baseline(self, target: Path) -> None:
        """Make ``baseline`` point at ``target`` (a folder under ``baselines/``); nothing is overwritten.

        A ``baseline`` folder from an older layout is moved under ``baselines/`` first.
        """
        link = self.current_baseline
        if link.is_dir() and not link.is_symlink():
            legacy = self.baselines / f"legacy.{new_id()}"
            legacy.parent.mkdir(parents=True, exist_ok=True)
            replace_durably(link, legacy)
        rel = os.path.relpath(target, self.path)
        tmp = self.path / f".baseline.{os.getpid()}.tmp"
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        try:
            os.symlink(rel, tmp, target_is_directory=True)
            replace_durably(tmp, link)
        except OSError:  # a file system without links: the current baseline's path, as text
            if tmp.is_symlink():
                tmp.unlink()
            log.warning("atlas: cannot link %s to %s; the current baseline is %s", link, target, target)

    def save_baseline(self, baseline: Any, target: Path) -> str | None:
        """Write ``baseline`` (a :class:`~atlas_tracking.artifacts.baseline.Baseline`) to ``target`` and point
        ``baseline`` at it; returns None, or the error (naming the file and the free space) when it is not on disk."""
        try:
            baseline.save(target)
        except OSError as exc:
            return str(named_error(exc, target))
        try:
            self.point_baseline(target)
        except OSError as exc:  # the baseline is on disk; only the link to it is stale
            log.warning("atlas: cannot point %s at %s (%s)", self.current_baseline, target, exc)
        return None

    def receipts_writer(self, step: int, encoded: tuple[str, str | bytes]) -> Callable[[], str]:
        """Writes the receipts of the gate at ``step`` (``(form, data)``, encoded) and returns their sha256: called
        before the gate's line is written, again after a write that failed."""
        form, data = encoded

        def write() -> str:
            write_atomic(self.receipts_target(step, form), data)
            return sha256_text(data)
        return write

    # --- repair --------------------------------------------------------------------------------
    def repair(self) -> dict[str, int]:
        """Undo what a killed writer leaves behind; returns the counts.

        A record file's last line without a newline is cut off (it was never a complete record);
        temporary files and folders of interrupted atomic writes are removed (never acknowledged). A gate
        whose line in ``gates.jsonl`` was cut is rebuilt from its whole receipts file and appended again
        (:mod:`atlas_tracking.artifacts.rebuild`), else counted as lost with one warning.
        """
        cut_gate = self.gates.read_bytes().rpartition(b"\n")[2] if self.gates.is_file() else b""
        torn = 0
        for name in RECORD_FILES:
            path = self.path / name
            if not path.is_file():
                continue
            fd = os.open(path, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                cut_torn_tail(fd, path)
                torn += int(os.fstat(fd).st_size != size)
            finally:
                os.close(fd)
        leftovers = 0
        for folder in (self.path, self.receipts, self.baselines):
            if not folder.is_dir():
                continue
            for tmp in folder.glob(".*"):
                if tmp.name.endswith(".tmp") or (folder == self.baselines and tmp.is_dir()):
                    if tmp.is_dir() and not tmp.is_symlink():
                        shutil.rmtree(tmp, ignore_errors=True)
                    else:
                        tmp.unlink(missing_ok=True)
                    leftovers += 1
        rebuilt = self._rebuild(cut_gate.decode(errors="replace")) if cut_gate.strip() else None
        return {"torn_lines_cut": torn, "temporary_files_removed": leftovers,
                "cut_gates_rebuilt": int(rebuilt is True), "cut_gates_lost": int(rebuilt is False)}

    def _rebuild(self, torn: str) -> bool | None:
        """Append the rebuilt record of a cut gate line: True when rebuilt, False when lost, None when the record
        already holds that gate."""
        record = rebuild_cut_gate(self, torn)
        if record is None:
            self._forget_delivered(torn)
            return False
        if key(record) in {key(r) for name in (self.gates, self.abandoned) for r in read_lines(name)}:
            return None
        record["receipts_sha256"] = file_sha256(self.receipts_file(record["step"]))
        append_line(self.gates, record)
        log.warning("atlas: the gate at step %s (branch %s), whose line a crash cut short, was rebuilt from %s",
                    record["step"], record["branch"], self.receipts_file(record["step"]))
        return True

    def _forget_delivered(self, torn: str) -> None:
        """A lost gate leaves ``delivered.jsonl`` too: the ledger names only gates the record holds, so a tracker
        that had it is not counted as holding a gate of the history at that step."""
        step = prefix_fields(torn).get("step")
        recorded = {key(r) for name in (self.gates, self.abandoned) for r in read_lines(name)}
        ledger = read_lines(self.delivered)
        kept = [d for d in ledger if d["step"] != step or key(d) in recorded]
        if len(kept) != len(ledger):
            write_lines(self.delivered, kept)

    # --- rewind --------------------------------------------------------------------------------
    def rewind(self, step: int, lineage: list[list[Any]] | None, branch: str | None,
               load_segments: list[list[Any]] | None = None, rollout_segments: list[list[Any]] | None = None) -> int:
        """Make the history the lineage of a training state restored at ``step``; returns gates moved.

        ``lineage`` lists the (step, branch) keys of the gates the restored state has read, and
        ``branch`` is the branch that saved it: its gates after the lineage's last step, up to
        ``step``, belong to the restored timeline too (a checkpoint written before its own gate).
        With ``lineage`` None (a state saved before branches were kept), the history is cut at
        ``step``. Every other gate goes to ``gates.abandoned.jsonl``; gates of the lineage found
        there come back. Each file is replaced atomically, in an order where a crash at any point
        leaves every gate in at least one file (the next rewind settles it); receipts follow. ``load.jsonl``
        follows ``load_segments`` and ``rollout.jsonl`` ``rollout_segments``, the training segments of the
        restored state's intervals and recorded steps (:func:`~atlas_tracking.artifacts.load_record.rewind_series`),
        and ``alerts.jsonl`` holds the alerts of the
        history's gates, failed gates and intervals.
        """
        live = read_lines(self.gates)
        parked = read_lines(self.abandoned)
        every: dict[tuple, dict[str, Any]] = {}
        for rec in parked + live:
            every.setdefault(identity(rec), rec)
        if lineage is None:
            history, _ = monotone(live)
            wanted = {identity(r) for r in history if r["step"] <= step}
        else:
            wanted = {(int(s), b) for s, b in lineage if int(s) <= step}
            last = max((s for s, _ in wanted), default=-1)
            wanted |= {k for k in every if k[1] == branch and last < k[0] <= step}
        history = sorted((every[k] for k in wanted if k in every), key=lambda r: r["step"])
        steps = [r["step"] for r in history]
        if len(set(steps)) != len(steps):
            raise HistoryError(f"{self.gates}: the restored lineage holds two gates at one step ({steps})")
        rest = [every[k] for k in every if k not in wanted]
        live_keys = [identity(r) for r in live]
        moved = sum(1 for k in live_keys if k not in wanted) + sum(1 for r in history if identity(r) not in live_keys)
        if moved == 0 and live_keys == [identity(r) for r in history] and len(parked) == len(rest):
            self._settle_receipts(history, rest)
        else:
            write_lines(self.abandoned, [every[k] for k in every])  # 1. a superset: nothing can be lost
            self._settle_receipts(history, rest)                    # 2. receipts follow their records
            write_lines(self.gates, history)                        # 3. the history
            write_lines(self.abandoned, rest)                       # 4. the abandoned branches only
        self._rewind_errors(step)
        rewind_load(self.path, step, load_segments)
        rewind_rollout(self.path, step, rollout_segments)
        alerts = sorted((a for r in [*history, *read_lines(self.errors), *read_lines(self.path / LOAD),
                                     *read_lines(self.path / ROLLOUT)]
                         for a in r.get("alerts", [])),
                        key=lambda a: a["step"])  # the history's alerts, its failed gates' and its intervals', in step order
        if read_lines(self.alerts) != alerts:
            write_lines(self.alerts, alerts)
        return moved

    def _rewind_errors(self, step: int) -> None:
        errors = read_lines(self.errors)
        gone = [e for e in errors if e["step"] > step]
        if gone:
            parked = read_lines(self.path / ERRORS_ABANDONED)
            write_lines(self.path / ERRORS_ABANDONED, parked + gone)
            write_lines(self.errors, [e for e in errors if e["step"] <= step])

    def _settle_receipts(self, history: list[dict[str, Any]], rest: list[dict[str, Any]]) -> None:
        """Receipts of the history at ``receipts/step_N.json`` (or ``.safetensors``); abandoned and unacknowledged
        ones aside.

        Files are kept by step and branch: ``receipts/step_N.json`` stays where it is while the history's
        gate at step N holds its sha256, even when an abandoned gate at that step holds the same one (a
        gate re-run on a new branch writes byte-identical receipts), and a history gate whose file is
        missing takes it back from ``receipts/abandoned/`` under whatever name it was parked.
        """
        if not self.receipts.is_dir():
            return
        parked_dir = self.receipts / "abandoned"
        by_step = {r["step"]: r for r in history}
        for rec in rest:
            sha = rec.get("receipts_sha256")
            kept = by_step.get(rec["step"])
            if kept is not None and kept.get("receipts_sha256") in (None, sha):
                continue  # the file is the history's gate's own
            for src in (self.receipts_file(rec["step"], form) for form in SUFFIXES):
                if sha and file_sha256(src) == sha:
                    parked_dir.mkdir(exist_ok=True)
                    replace_durably(src, parked_dir / f"step_{rec['step']:08d}.{rec.get('branch')}{src.suffix}")
        for path in sorted(p for suffix in FORMS for p in self.receipts.glob(f"step_*{suffix}")):
            try:
                step = int(path.stem.split("_", 1)[1])
            except ValueError:
                continue
            rec = by_step.get(step)
            sha = file_sha256(path)
            if rec is not None and (rec.get("receipts_sha256") in (None, sha)):
                continue
            parked_dir.mkdir(exist_ok=True)
            replace_durably(path, parked_dir / f"step_{step:08d}.unacknowledged.{(sha or 'x')[:12]}{path.suffix}")
        for rec in history:
            dst = self.receipts_file(rec["step"])
            sha = rec.get("receipts_sha256")
            if dst.exists() or not sha or not parked_dir.is_dir():
                continue
            own = [parked_dir / f"step_{rec['step']:08d}.{rec.get('branch')}{suffix}" for suffix in FORMS]
            others = sorted(p for suffix in FORMS for p in parked_dir.glob(f"step_{rec['step']:08d}.*{suffix}"))
            for src in [*own, *others]:
                if src.exists() and file_sha256(src) == sha:
                    replace_durably(src, self.receipts_file(rec["step"], FORMS[src.suffix]))
                    break

    # --- tracker ledger ------------------------------------------------------------------------
    def waiting(self) -> dict[str, dict[str, Any]]:
        """``backlog.json``: per sink, its tracker run (None when unknown) and the ``[step, branch]`` of each gate
        it had not received when training ended ({} without the file)."""
        return json.loads(self.backlog.read_text())["sinks"] if self.backlog.exists() else {}

    def delivered_keys(self, sink: str, run: str) -> set[tuple[int, str | None]]:
        return {(int(d["step"]), d.get("branch")) for d in read_lines(self.delivered)
                if d.get("sink") == sink and d.get("run") == run}
