"""Record writes that wait for the disk: a gate commits when its line is written, or it did not happen.

A gate's receipts file and its line in ``gates.jsonl`` are written before anything moves: the policy's state, the
lineage and the checkpointed state advance only once the line is durably on disk
(:meth:`~atlas_tracking.gate.AtlasGate.run`). When a write fails (a full disk), the gate is held here in memory,
whole, with the state it leads to; the lines of its failure (``errors.jsonl``, ``alerts.jsonl``) wait beside it. At
every later call (the next gate, an optimizer step, the end of training) the held writes are tried again, in order:
a gate's line is written whole from its record in memory (a write that failed part-way took its cut line back, so
nothing torn is ever read as a gate) and logged as a repair, and only then does the gate commit. Gates that are
still held when training ends are lost, and the record says nothing of them but their failures: the history on
disk and the checkpointed state always agree, so ``replay`` of the history is what ran live. A resume in the same
process writes what waits first, uncommitted, as the record of the segment it came from (the rewind then files it),
and drops what the disk still refuses: nothing held before a resume is written into the restored history.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from atlas_tracking.sinks.jsonl import JsonlSink
    >>> run = Path(tempfile.mkdtemp())
    >>> held = Held(JsonlSink(run / "gates.jsonl"))
    >>> held.hold(HeldGate({"step": 10}, {}, 10, [{"step": 10, "title": "t"}], None, None, "OSError: full"))
    >>> held.line("errors.jsonl", {"step": 10, "error": "OSError: full"})
    >>> held.waiting()
    2
    >>> [g.record["step"] for g in held.flush()], held.waiting(), (run / "gates.jsonl").read_text()
    ([10], 0, '{"step":10}\\n')
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from atlas_tracking.artifacts.history import append_line
from atlas_tracking.schema.artifacts import ALERTS
from atlas_tracking.sinks.jsonl import JsonlSink

log = logging.getLogger("atlas_tracking")


@dataclass
class HeldGate:
    """A gate measured and read, waiting for its receipts and its line to be written."""

    record: dict[str, Any]
    metrics: dict[str, float]
    step: int
    """The step trackers plot it at."""
    events: list[dict[str, Any]]
    receipts: Callable[[], str] | None
    """Writes the gate's receipts file and returns its sha256 (None: written, or not kept)."""
    after: Any
    """What the gate commits once its line is written (the policy and alert state it leads to, its retention)."""
    failed: str | None = None
    """The error of the first write that failed (None: not tried yet)."""


class Held:
    """The writes of the local record that wait for the disk, in the order they were made."""

    def __init__(self, local: JsonlSink):
        self.local = local
        self.gates: list[HeldGate] = []
        self.lines: list[tuple[str, dict[str, Any]]] = []
        self.error: OSError | None = None
        """The error of the last write tried (None: the last flush wrote everything)."""

    def waiting(self) -> int:
        """Records (gates, and lines of the record files) still held in memory."""
        return len(self.gates) + len(self.lines)

    def hold(self, gate: HeldGate) -> None:
        self.gates.append(gate)

    def line(self, name: str, obj: dict[str, Any]) -> None:
        """A line of a record file (its name in the run directory: ``errors.jsonl``, ``alerts.jsonl``, ``load.jsonl``,
        ``rollout.jsonl``) to write, in turn."""
        self.lines.append((name, obj))

    def ahead(self) -> Any:
        """The state the last held gate leads to (None when no gate is held)."""
        return self.gates[-1].after if self.gates else None

    def drop(self) -> int:
        """Forget everything held (a resume: what still waits belongs to the process's abandoned segment); returns
        how many records were dropped."""
        count = self.waiting()
        self.gates, self.lines = [], []
        return count

    def take(self, count: int) -> list[HeldGate]:
        """The first ``count`` held gates, gone from here (on a rank that does not write: rank zero wrote them)."""
        done, self.gates = self.gates[:count], self.gates[count:]
        return done

    def flush(self) -> list[HeldGate]:
        """Write what waits, in order, until a write fails (:attr:`error`); returns the gates whose lines are now
        on disk (they commit), each with its alert lines queued behind."""
        self.flush_lines()
        done: list[HeldGate] = []
        while self.gates and self.error is None:
            gate = self.gates[0]
            try:
                if gate.receipts is not None:
                    gate.record["receipts_sha256"] = gate.receipts()
                    gate.receipts = None
                self.local.log_gate(gate.record, gate.metrics, gate.step)
            except OSError as exc:
                self.error = exc
                break
            self.gates.pop(0)
            done.append(gate)
            if gate.failed is not None:
                log.warning("atlas: repaired the record: the gate at step %s (branch %s), whose write failed (%s), "
                            "was written whole to %s from its record held in memory", gate.record["step"],
                            gate.record.get("branch"), gate.failed, self.local.path)
            self.lines.extend((ALERTS, event) for event in gate.events)
            self.flush_lines()
        for waiting in self.gates if self.error is not None else []:  # held behind the write that failed
            waiting.failed = waiting.failed or f"{type(self.error).__name__}: {self.error}"
        return done

    def flush_lines(self) -> None:
        """Write the held lines, in order, until a write fails (:attr:`error`)."""
        self.error = None
        while self.lines:
            name, obj = self.lines[0]
            try:
                append_line(self.local.path.with_name(name), obj)
            except OSError as exc:
                self.error = exc
                return
            self.lines.pop(0)
