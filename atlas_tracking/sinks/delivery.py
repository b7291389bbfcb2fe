"""Where gate records and alerts go: the local JSONL record first, then trackers, never fatally.

A sink has a ``name``, ``log_gate(record, metrics, step)``, ``alert(event)`` and ``finish()``
(accelerate's tracker shape); a tracker sink also has ``run_key``, the identity of the tracker
run it writes to. :class:`Delivery` fans a gate out: it appends the record to
``atlas/gates.jsonl`` before anything else, then calls every sink inside a guard. A sink that
fails (a tracker server down, a network error) produces one warning naming what was not
delivered; its calls are kept in a bounded backlog and replayed, in order, at the next gate,
so delivery resumes when the service is back. Training never dies because monitoring failed.
When a tracker run has received a gate and its alerts, a line in ``delivered.jsonl`` says so;
after a restart, :meth:`Delivery.catch_up` sends each tracker run the gates of the history it
has not received (a new tracker run gets the whole history).

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
    >>> [json.loads(line)["step"] for line in open(d + "/gates.jsonl")], delivery.backlog_size("broken")
    ([1], 1)
"""

from __future__ import annotations

import logging
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

from atlas_tracking.artifacts.history import key
from atlas_tracking.sinks.base import tracker_run
from atlas_tracking.sinks.jsonl import JsonlSink

log = logging.getLogger("atlas_tracking")


def _warn(message: str) -> None:
    """Tracker trouble is a Python warning (visible in any training loop) and a log line."""
    log.warning(message)
    warnings.warn(message, UserWarning, stacklevel=3)


def _what(method: str, args: tuple) -> str:
    if method == "log_gate":
        return f"gate step {args[2]}"
    if method == "alert":
        return f"alert {args[0].get('title')!r}"
    return f"the note that it holds gate step {args[1]['step']}"


class Delivery:
    """Local record first, then every sink, each guarded with a replaying backlog.

    A sink's backlog holds units (a gate with its alerts and the note that the tracker run holds
    it); a full backlog (``backlog_limit`` gates and alerts) drops whole units, oldest first, with a
    warning: what a tracker run lacks is sent again from the record at the next resume.
    """

    def __init__(
        self,
        local: JsonlSink | None,
        sinks: list[Any],
        warn: Callable[[str], None] | None = None,
        backlog_limit: int = 1000,
    ):
        self.local = local
        self.sinks = list(sinks)
        self.warn = warn or _warn
        self.backlog_limit = backlog_limit
        self._backlog: dict[str, deque[list[tuple[str, tuple]]]] = {s.name: deque() for s in self.sinks}
        self._down: set[str] = set()

    def add(self, sink: Any) -> None:
        """Deliver to one more sink from the next call on (no-op if a sink of that name is present)."""
        if sink.name in self._backlog:
            return
        self.sinks.append(sink)
        self._backlog[sink.name] = deque()

    def backlog_size(self, name: str) -> int:
        """Gates and alerts queued for a sink that is down."""
        return sum(1 for unit in self._backlog.get(name, ()) for method, _ in unit if method != "acknowledge")

    def _call(self, sink: Any, items: list[tuple[str, tuple]]) -> None:
        queue = self._backlog[sink.name]
        queue.append(list(items))
        if not self._drain(sink, queue):
            dropped = 0
            while self.backlog_size(sink.name) > self.backlog_limit and len(queue) > 1:
                queue.popleft()
                dropped += 1
            if dropped:
                self.warn(f"atlas: {sink.name} backlog is full; the {dropped} oldest queued gate(s) or alert(s) "
                          "were dropped from memory (they stay in the local record and are sent at the next resume)")

    def _drain(self, sink: Any, queue: deque[list[tuple[str, tuple]]]) -> bool:
        """Deliver queued units in order; False when the sink failed (the rest stays queued)."""
        while queue:
            unit = queue[0]
            while unit:
                m, a = unit[0]
                try:
                    if m == "acknowledge":
                        if self.local is not None:
                            self.local.acknowledge(sink.name, *a)
                    else:
                        getattr(sink, m)(*a)
                except Exception as exc:  # a tracker must never stop training
                    if sink.name not in self._down:
                        self._down.add(sink.name)
                        self.warn(
                            f"atlas: {sink.name} did not receive {_what(m, a)} ({type(exc).__name__}: "
                            f"{str(exc)[:200]}); kept locally, {self.backlog_size(sink.name)} item(s) queued for "
                            "retry at the next gate"
                        )
                    return False
                unit.pop(0)
            queue.popleft()
        if sink.name in self._down:
            self._down.discard(sink.name)
            self.warn(f"atlas: {sink.name} is reachable again; queued gates and alerts were delivered")
        return True

    def _send(self, sink: Any, record: dict[str, Any], metrics: dict[str, float], step: int,
              alerts: list[dict[str, Any]]) -> None:
        items = [("log_gate", (record, metrics, step)), *(("alert", (event,)) for event in alerts)]
        run = tracker_run(sink)
        if run is not None:
            items.append(("acknowledge", (run, record)))
        self._call(sink, items)

    def gate(self, record: dict[str, Any], metrics: dict[str, float], step: int,
             alerts: list[dict[str, Any]] = ()) -> None:
        """The record (and its alerts) to the local files, then gate and alerts to every sink."""
        if self.local is not None:
            self.local.log_gate(record, metrics, step)
            for event in alerts:
                self.local.alert(event)
        for sink in self.sinks:
            self._send(sink, record, metrics, step, list(alerts))

    def alert(self, event: dict[str, Any]) -> None:
        if self.local is not None:
            self.local.alert(event)
        for sink in self.sinks:
            self._call(sink, [("alert", (event,))])

    def catch_up(self, history: list[dict[str, Any]], metrics_of: Callable[[dict[str, Any]], dict[str, float]],
                 step_of: Callable[[dict[str, Any]], int]) -> int:
        """Send every tracker run the history's gates (with their alerts) it has not received; returns the count."""
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

    def finish(self) -> None:
        for sink in self.sinks:
            try:
                sink.finish()
            except Exception as exc:
                self.warn(f"atlas: {sink.name} failed to finish ({type(exc).__name__})")
