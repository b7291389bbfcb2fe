"""Where gate records and alerts go: the local JSONL record first, then trackers, never fatally.

A sink has a ``name``, ``log_gate(record, metrics, step)``, ``alert(event)`` and ``finish()``
(accelerate's tracker shape), and may have ``log_load(line, metrics, step, picture)`` for the training-batch
load between gates (:meth:`Delivery.load`); a tracker sink also has ``run_key``, the identity of the tracker
run it writes to. :class:`Delivery` fans a gate out: it appends the record to
``atlas/gates.jsonl`` before anything else, on the calling thread, then queues the gate for every
sink; each sink's calls run in order on its own background thread
(:class:`~atlas_tracking.sinks.worker.SinkWorker`), so a tracker that is slow or never answers does
not hold training. A sink that fails (a tracker server down, a network error) produces one warning
naming what was not delivered; its calls stay queued, bounded, and are retried, in order, at the next
gate, so delivery resumes when the service is back. Training never dies because monitoring failed.
When a tracker run has received a gate and its alerts, a line in ``delivered.jsonl`` says so (the
ground truth of what was delivered); after a restart, :meth:`Delivery.catch_up` sends each tracker
run the gates of the history it has not received (a new tracker run gets the whole history). At the
end of training, :meth:`Delivery.finish` waits a bounded time (``gate.delivery_wait_s``), then says
how many gates each sink still lacks and how to deliver them.

Example:
    >>> import tempfile, json
    >>> d = tempfile.mkdtemp()
    >>> class Broken:
    ...     name = "broken"
    ...     def log_gate(self, record, metrics, step): raise ConnectionError("server down")
    ...     def alert(self, event): pass
    ...     def finish(self): pass
    >>> delivery = Delivery(JsonlSink(d + "/gates.jsonl"), [Broken()], warn=lambda msg: None)
    >>> delivery.gate({"step": 1, "c2": 0.1}, {"atlas/c2": 0.1}, step=1)
    >>> delivery.wait(timeout_s=5.0)
    {'broken': 1}
    >>> [json.loads(line)["step"] for line in open(d + "/gates.jsonl")], delivery.backlog_size("broken")
    ([1], 1)
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atlas_tracking.artifacts.history import key
from atlas_tracking.schema.artifacts import BACKLOG
from atlas_tracking.sinks.base import tracker_run
from atlas_tracking.sinks.held import Held
from atlas_tracking.sinks.jsonl import JsonlSink
from atlas_tracking.sinks.worker import INTERVAL, ROLLOUT_STEP, SinkWorker, pending_gates

log = logging.getLogger("atlas_tracking")


def warn_operator(message: str) -> None:
    """Tracker trouble is one Python warning (visible in any training loop; ``logging.captureWarnings`` sends it to
    the log), never also a log line of its own."""
    warnings.warn(message, UserWarning, stacklevel=3)


def _what(method: str, args: tuple) -> str:
    if method == "log_gate":
        return f"gate step {args[2]}"
    if method == INTERVAL:
        return f"the training-batch load of step {args[0]['step']}"
    if method == ROLLOUT_STEP:
        return f"the rollout agreement of step {args[0]['step']}"
    if method == "alert":
        return f"alert {args[0].get('title')!r}"
    return f"the note that it holds gate step {args[0]['step']}"


def backlog_message(name: str, gates: int, wait_s: float, local: JsonlSink | None) -> str:
    """What the operator is told at the end of training about the gates a sink has not received.

    >>> print(backlog_message("mlflow", 3, 10.0, JsonlSink("run/atlas/gates.jsonl")))
    atlas: 3 gate(s) did not reach mlflow by the end of training (waited up to 10 s, gate.delivery_wait_s); they stay in run/atlas/gates.jsonl and are listed in run/atlas/backlog.json. To deliver them, resume the run from a checkpoint: each tracker run is sent the gates delivered.jsonl does not list (docs/trackers.md#catch-up); `atlas-tracking gates run/atlas` shows what each tracker still lacks
    """
    where = "the local record" if local is None else str(local.path)
    folder = "the run directory" if local is None else str(local.path.parent)
    listed = "" if local is None else f" and are listed in {local.path.with_name(BACKLOG)}"
    return (f"atlas: {gates} gate(s) did not reach {name} by the end of training (waited up to {wait_s:g} s, "
            f"gate.delivery_wait_s); they stay in {where}{listed}. To deliver them, resume the run from a "
            "checkpoint: each tracker run is sent the gates delivered.jsonl does not list "
            f"(docs/trackers.md#catch-up); `atlas-tracking gates {folder}` shows what each tracker still lacks")


class Delivery:
    """Local record first, then every sink through its own ordered background queue.

    A sink's queue holds units (a gate with its alerts and the note that the tracker run holds it); a
    queue over ``backlog_limit`` gates and alerts drops whole units, oldest first, with a warning: what a
    tracker run lacks is sent again from the record at the next resume. :meth:`finish` waits at most
    ``wait_s`` seconds for the queues (not at all for a call already running ``wait_s`` seconds), then
    says how many gates each sink still lacks and writes them to ``backlog.json`` beside the record.
    """

    def __init__(
        self,
        local: JsonlSink | None,
        sinks: list[Any],
        warn: Callable[[str], None] | None = None,
        backlog_limit: int = 1000,
        wait_s: float = 10.0,
    ):
        self.local = local
        self.sinks: list[Any] = []
        self.warn = warn or warn_operator
        self.backlog_limit = backlog_limit
        self.wait_s = wait_s
        self._workers: dict[str, SinkWorker] = {}
        self._ledger = threading.Lock()
        for sink in sinks:
            self.add(sink)

    def add(self, sink: Any) -> None:
        """Deliver to one more sink from the next call on (no-op if a sink of that name is present)."""
        if sink.name in self._workers:
            return
        self.sinks.append(sink)
        self._workers[sink.name] = SinkWorker(
            sink.name, lambda item: self._deliver(sink, item),
            failed=lambda item, exc, again: None if again else self._failed(sink.name, item, exc),
            recovered=lambda: self.warn(f"atlas: {sink.name} is reachable again; queued gates and alerts were delivered"),
            limit=self.backlog_limit, dropped=lambda n: self._dropped(sink.name, n),
            dropped_intervals=lambda n: self._dropped_intervals(sink.name, n))

    def backlog_size(self, name: str) -> int:
        """Gates and alerts not yet delivered to a sink (queued, or in flight)."""
        worker = self._workers.get(name)
        return 0 if worker is None else worker.size()

    def _deliver(self, sink: Any, item: tuple[str, tuple]) -> None:
        method, args = item
        if method != "acknowledge":
            getattr(sink, method)(*args)
            return
        run = tracker_run(sink)
        if run is not None and self.local is not None:
            with self._ledger:  # one writer of delivered.jsonl at a time
                self.local.acknowledge(sink.name, run, *args)

    def _failed(self, name: str, item: tuple[str, tuple], exc: Exception) -> None:
        self.warn(f"atlas: {name} did not receive {_what(*item)} ({type(exc).__name__}: {str(exc)[:200]}); kept "
                  f"locally, {self.backlog_size(name)} item(s) queued for retry at the next gate")

    def _dropped(self, name: str, dropped: int) -> None:
        self.warn(f"atlas: {name} backlog is full; the {dropped} oldest queued gate(s) or alert(s) "
                  "were dropped from memory (they stay in the local record and are sent at the next resume)")

    def _dropped_intervals(self, name: str, dropped: int) -> None:
        self.warn(f"atlas: {name} backlog is full; the {dropped} oldest queued training-batch load interval(s) or "
                  f"rollout step(s) were dropped from memory (they stay in load.jsonl and rollout.jsonl; at most "
                  f"{self.backlog_limit} of them wait for a tracker, apart from its gates and alerts)")

    def _call(self, sink: Any, items: list[tuple[str, tuple]]) -> None:
        self._workers[sink.name].put(items)

    def _send(self, sink: Any, record: dict[str, Any], metrics: dict[str, float], step: int,
              alerts: list[dict[str, Any]]) -> None:
        items = [("log_gate", (record, metrics, step)), *(("alert", (event,)) for event in alerts)]
        self._call(sink, [*items, ("acknowledge", (record,))])

    def gate(self, record: dict[str, Any], metrics: dict[str, float], step: int,
             alerts: list[dict[str, Any]] = ()) -> None:
        """The record (and its alerts) to the local files, then gate and alerts queued for every sink."""
        if self.local is not None:
            self.local.log_gate(record, metrics, step)
            for event in alerts:
                self.local.alert(event)
        self.send(record, metrics, step, alerts)

    def send(self, record: dict[str, Any], metrics: dict[str, float], step: int,
             alerts: list[dict[str, Any]] = ()) -> None:
        """A gate (and its alerts) the local record already holds, queued for every sink."""
        record, metrics, alerts = copy.deepcopy((record, metrics, list(alerts)))  # the caller may change its own
        for sink in self.sinks:
            self._send(sink, record, metrics, step, alerts)

    def alert(self, event: dict[str, Any]) -> None:
        """An alert between gates: ``alerts.jsonl``, then every sink (still told when the disk is full)."""
        if self.local is not None:
            try:
                self.local.alert(event)
            except OSError as exc:
                log.error("atlas: the alert %r could not be written (%s); the trackers still receive it",
                          event.get("title"), exc)
        self.notify(event)

    def notify(self, event: dict[str, Any]) -> None:
        """An alert queued for every sink, without the local record (which may be on a full disk)."""
        for sink in self.sinks:
            self._call(sink, [("alert", (copy.deepcopy(event),))])

    def load(self, line: dict[str, Any], metrics: dict[str, float], step: int, picture: bool) -> None:
        """One interval of training-batch load (already in ``load.jsonl``) queued for every sink that takes one
        (``log_load(line, metrics, step, picture)``; ``picture``: draw the layers x experts picture and table)."""
        self._series(INTERVAL, line, metrics, step, picture)

    def rollout(self, line: dict[str, Any], metrics: dict[str, float], step: int) -> None:
        """One recorded step of rollout agreement (already in ``rollout.jsonl``) queued for every sink that takes
        one (``log_rollout(line, metrics, step)``)."""
        self._series(ROLLOUT_STEP, line, metrics, step)

    def _series(self, method: str, line: dict[str, Any], metrics: dict[str, float], *args: Any) -> None:
        takers = [sink for sink in self.sinks if callable(getattr(sink, method, None))]
        if not takers:
            return
        line, metrics = copy.deepcopy((line, metrics))  # once, for every sink: the caller may change its own
        for sink in takers:
            self._call(sink, [(method, (line, metrics, *args))])

    def catch_up(self, history: list[dict[str, Any]], metrics_of: Callable[[dict[str, Any]], dict[str, float]],
                 step_of: Callable[[dict[str, Any]], int]) -> int:
        """Queue for every tracker run the history's gates (with their alerts) it has not received; returns the count."""
        sent = 0
        if self.local is None:
            return sent
        for sink in self.sinks:
            run = tracker_run(sink)
            if run is None:
                continue
            have = self.local.delivered(sink.name, run)
            for record in history:
                if key(record) not in have:
                    self._send(sink, record, metrics_of(record), step_of(record), record.get("alerts", []))
                    sent += 1
        return sent

    def wait(self, timeout_s: float | None = None) -> dict[str, int]:
        """Retry every queue and wait for it, at most ``timeout_s`` seconds in all (default ``wait_s``) and not
        for a sink whose call has been running that long; returns the gates and alerts each sink still lacks."""
        timeout_s = self.wait_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        for worker in self._workers.values():
            worker.kick()
        for worker in self._workers.values():
            worker.wait(deadline, stalled_after=timeout_s)
        return {name: worker.size() for name, worker in self._workers.items()}

    def backlog(self) -> dict[str, list[tuple[int, str | None]]]:
        """Per sink, the (step, branch) of each gate it has not received yet, in order."""
        return {name: [key(record) for record in pending_gates(worker.pending())]
                for name, worker in self._workers.items()}

    def finish(self) -> dict[str, list[tuple[int, str | None]]]:
        """The end of training: the bounded wait, then one warning per sink that still lacks gates (with how to
        deliver them later) and ``backlog.json`` beside the record; each sink not in the middle of a call is
        finished. Returns the gates each sink still lacks."""
        self.wait()
        backlog = self.backlog()
        runs = {sink.name: tracker_run(sink) for sink in self.sinks if backlog[sink.name]}
        if self.local is not None:
            try:
                self.local.note_backlog(backlog, runs)
            except OSError as exc:  # a full disk: the warnings below still say what each sink lacks
                self.warn(f"atlas: the backlog could not be written ({exc})")
        for name, gates in backlog.items():
            if gates:
                self.warn(backlog_message(name, len(gates), self.wait_s, self.local))
        for sink in self.sinks:
            worker = self._workers[sink.name]
            if worker.idle():
                try:
                    sink.finish()
                except Exception as exc:
                    self.warn(f"atlas: {sink.name} failed to finish ({type(exc).__name__})")
            worker.close()
        return backlog


@dataclass
class Writer:
    """Where rank zero writes what it records between gates (a load interval, a rollout step): the run directory,
    the run's identity, the delivery and the record's writes that wait for the disk."""

    run_dir: Path
    run_id: str | None
    branch: str
    delivery: Delivery
    held: Held
    """The gate's writes that wait for the disk (:mod:`atlas_tracking.sinks.held`): a line goes in turn behind them."""

    def append(self, name: str, line: dict[str, Any], what: str) -> None:
        """Append ``line`` (``what`` it records, for the log) to the run directory's ``name``, complete on disk, in
        turn behind any line still waiting. A line the disk refuses waits in memory, whole, is written at the gate's
        next try (an optimizer step, a gate, the end of training), and the log says so; it never raises."""
        self.held.line(name, line)
        self.held.flush_lines()
        if any(waiting is line for _, waiting in self.held.lines):
            log.error("atlas: %s could not be written to %s (%s); it waits in memory and is written, in turn, as soon "
                      "as the disk has room", what, self.run_dir, self.held.error)
