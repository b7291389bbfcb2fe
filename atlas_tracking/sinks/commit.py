"""A gate commits when its line is written, or it did not happen: the flows of :class:`~atlas_tracking.gate.AtlasGate`
around the disk (docs/record.md#a-full-disk).

:class:`CommitOnWrite` is the part of the gate that writes what waits for the disk (:mod:`atlas_tracking.sinks.held`)
and commits the gates written, in order: the policy and alert state each one leads to, the lineage, the
checkpointed baseline, its delivery to the trackers and its retention. It also keeps the baseline a gate takes only
once it is on disk. Rank zero writes; every rank hears what was written and commits the same gates.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from atlas_tracking.artifacts.baseline import Baseline
from atlas_tracking.engine.collectives import from_rank_zero
from atlas_tracking.sinks.held import Held

log = logging.getLogger("atlas_tracking")


def is_rank_zero() -> bool:
    """The process that writes the record: rank zero under ``torch.distributed``, else the only one."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class CommitOnWrite:
    """What a gate does around the disk (mixed into :class:`~atlas_tracking.gate.AtlasGate`, whose state it moves)."""

    held: Held
    run_dir: Any
    branch: str
    baseline: Baseline | None
    baseline_path: str | None
    committed_baseline_path: str | None
    lineage: list[list[Any]]
    gates_run: int
    _claimed: bool
    _reference_note: str | None

    def _flush(self) -> str | None:
        """Write what waits for the disk (collective while a gate is held); the gates written commit, in order.
        Returns the error of a write that failed (None: nothing waits)."""
        if not self.held.gates:
            if is_rank_zero() and self._claimed:
                self.held.flush_lines()
            return None
        done = self.held.flush() if is_rank_zero() else []
        count, error = from_rank_zero((len(done), str(self.held.error) if self.held.error else None))
        for held in done if is_rank_zero() else self.held.take(count):
            self.policy, self.alerts = held.after["policy"], held.after["alerts"]
            self.gates_run += 1
            self.lineage.append([int(held.record["step"]), held.record["branch"]])
            self.committed_baseline_path = held.record.get("baseline_path")
            self._keep_base(held.record)
            if is_rank_zero():
                self.delivery.send(held.record, held.metrics, held.step, held.events)
                self._prune(held.after["plan"])
        return error

    def _file_held(self, step: int) -> None:
        """A resume in the same process: what waits for the disk is written as the record of the segment it came from,
        uncommitted (the restored state replaces this process's), so that the rewind files it like any record of that
        segment; what the disk still refuses is dropped, never written into the restored history later."""
        error: Any = None
        if is_rank_zero() and self.held.waiting():
            try:
                self.held.flush()
                error = self.held.error
            except Exception as exc:  # monitoring never stops a resume: what is left is dropped below, and said
                error = f"{type(exc).__name__}: {exc}"
        dropped = self.held.drop()  # every rank: its copies of the held gates go too
        if dropped and is_rank_zero():
            log.error("atlas: %d record(s) of the segment before the resume at step %s could not be written (%s): "
                      "they are lost, not written into the restored history", dropped, step, error)

    def _take_baseline(self, step: int, report: Any) -> str | None:
        """This gate's measurement becomes the baseline once it is on disk. A baseline that cannot be written is not
        a baseline: the last one on disk stays the reference (or none: the next gate takes a new one); returns what
        the record says about it then."""
        fresh, target = Baseline.from_report(report), self.run_dir.baseline_dir(step, self.branch)
        failed = from_rank_zero(self.run_dir.save_baseline(fresh, target) if is_rank_zero() else None)
        if failed is None:
            self.baseline, self.baseline_path, self._reference_note = fresh, str(target), None
            return None
        if self.baseline_path is None or not from_rank_zero(Path(self.baseline_path).is_dir()):
            self.baseline, self.baseline_path = None, None
        kept = (f"gates measure against {self.baseline_path}, the last baseline on disk" if self.baseline_path
                else "no baseline is on disk: the next gate takes a new one")
        self._reference_note = f"the baseline of step {step} could not be written ({failed}); {kept}"
        log.error("atlas: %s", self._reference_note)
        return self._reference_note
