"""One sink's ordered queue, delivered by its own background thread, off the training thread.

A :class:`SinkWorker` holds units (lists of calls: a gate with its alerts and the note that the tracker run
holds it) and hands each call, in order, to ``deliver`` on a daemon thread, so a tracker that is slow or
never answers costs the training thread nothing but the time to queue. A call that raises stays at the
front of the queue; the worker waits for the next :meth:`SinkWorker.put` (the next gate) or
:meth:`SinkWorker.kick` before it retries. :meth:`SinkWorker.wait` is the bounded wait at the end of
training: it returns when the queue is delivered, at the deadline, or at once for a sink whose call has
been running for ``stalled_after`` seconds (a tracker that accepts connections and never answers).

Example:
    >>> import time
    >>> got = []
    >>> worker = SinkWorker("demo", got.append, failed=lambda item, exc, again: None)
    >>> worker.put([("log_gate", (1,)), ("alert", (2,))])
    >>> worker.wait(time.monotonic() + 5.0, stalled_after=5.0), got
    (True, [('log_gate', (1,)), ('alert', (2,))])
    >>> worker.close()
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

Item = tuple[str, tuple]
"""One call: the sink method's name and its arguments."""


INTERVAL = "log_load"
"""The call that delivers one interval of training-batch load: a queue keeps at most ``limit`` of them after a
failure (the oldest dropped first), apart from the gates and alerts, which they never push out."""
ROLLOUT_STEP = "log_rollout"
"""The call that delivers one recorded step of rollout agreement: bounded with the intervals, apart from gates."""
SERIES = (INTERVAL, ROLLOUT_STEP)
"""The calls between gates (:data:`INTERVAL`, :data:`ROLLOUT_STEP`), bounded apart from the gates and alerts."""


def _counts(item: Item) -> bool:
    """Gates and alerts count towards a backlog; the note that a tracker run holds a gate, and the series between
    gates (bounded apart, :data:`SERIES`), do not."""
    return item[0] not in ("acknowledge", *SERIES)


def _interval(unit: list[Item]) -> bool:
    return bool(unit) and all(item[0] in SERIES for item in unit)


class SinkWorker:
    """A daemon thread that delivers one sink's units in order; see the module docstring.

    Args:
        name: the sink's name (the thread is called ``atlas-delivery-<name>``).
        deliver: performs one call; an exception leaves the call queued.
        failed: told of a failed call with the exception and whether the sink had already failed before.
        recovered: told when a sink that had failed has delivered its whole queue.
        limit: the most gates and alerts kept after a failure (one more unit while a call is running); older
            units are dropped, whole, oldest first, and ``dropped`` is told how many. Apart from them, at most
            ``limit`` intervals and rollout steps (:data:`SERIES`) are kept, the oldest dropped first, and ``dropped_intervals`` is
            told how many.
    """

    def __init__(self, name: str, deliver: Callable[[Item], None],
                 failed: Callable[[Item, Exception, bool], None], recovered: Callable[[], None] = lambda: None,
                 limit: int = 1000, dropped: Callable[[int], None] = lambda n: None,
                 dropped_intervals: Callable[[int], None] = lambda n: None):
        self.name, self.limit = name, limit
        self._deliver, self._failed, self._recovered, self._dropped = deliver, failed, recovered, dropped
        self._dropped_intervals = dropped_intervals
        self._units: deque[list[Item]] = deque()
        self._current: list[Item] | None = None
        self._since: float | None = None
        self._wake = self._running = self._closed = False
        self.down = False
        """The last call failed: the queue waits for the next gate (or :meth:`kick`) to be retried."""
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def _size(self) -> int:
        return sum(1 for unit in ([self._current] if self._current else []) + list(self._units)
                   for item in unit if _counts(item))

    def size(self) -> int:
        """Gates and alerts not delivered yet (queued or in flight)."""
        with self._cond:
            return self._size()

    def pending(self) -> list[Item]:
        """Every call not delivered yet, in order (the one in flight first)."""
        with self._cond:
            return [item for unit in ([self._current] if self._current else []) + list(self._units) for item in unit]

    def _trim(self, limit: int) -> tuple[int, int]:
        """Drop whole queued units, oldest first, until at most ``limit`` gates and alerts wait (never the newest
        unit, nor the one in flight), and at most ``self.limit`` intervals; returns how many units of gates and
        alerts, and how many intervals, were dropped. Called with the lock held."""
        intervals = [unit for unit in self._units if _interval(unit)]
        stale = intervals[:max(0, len(intervals) - self.limit)]
        for unit in stale:
            self._units.remove(unit)
        dropped = 0
        while self._size() > limit and len(self._units) > 1:
            drop = next((u for u in self._units if not _interval(u)), None)
            if drop is None or drop is self._units[-1]:
                break
            self._units.remove(drop)
            dropped += 1
        return dropped, len(stale)

    def _report(self, dropped: tuple[int, int]) -> None:
        """Say what :meth:`_trim` dropped (called without the lock)."""
        if dropped[0]:
            self._dropped(dropped[0])
        if dropped[1]:
            self._dropped_intervals(dropped[1])

    def put(self, unit: list[Item]) -> None:
        """Queue a unit and wake the worker (a queue over ``limit`` plus this unit drops its oldest units)."""
        with self._cond:
            self._units.append(list(unit))
            dropped = self._trim(self.limit + sum(1 for item in unit if _counts(item)))
            self._wake = True
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"atlas-delivery-{self.name}", daemon=True)
                self._thread.start()
        self._report(dropped)

    def kick(self) -> None:
        """Retry the queue now (at the end of training), as the next gate would."""
        with self._cond:
            if self._units or self._current:
                self._wake = True
                self._cond.notify_all()

    def idle(self) -> bool:
        """Nothing is being delivered: the queue is empty, or it waits for a retry after a failure."""
        with self._cond:
            return not (self._wake or self._running)

    def wait(self, deadline: float, stalled_after: float) -> bool:
        """Wait until the worker is idle, at most until ``deadline`` (``time.monotonic``) and not while a call
        has been running for ``stalled_after`` seconds; True when it is idle."""
        with self._cond:
            while self._wake or self._running:
                now = time.monotonic()
                until = deadline if self._since is None else min(deadline, self._since + stalled_after)
                if now >= until:
                    return False
                self._cond.wait(until - now)
            return True

    def close(self) -> None:
        """Let the thread end once its queue is delivered or a call fails (it never interrupts a call)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._wake:
                    if self._closed:
                        self._thread = None
                        return
                    self._cond.wait()
                self._wake, self._running = False, True
            try:
                self._drain()
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._current:
                    if not self._units:
                        recovered, self.down = self.down, False
                        break
                    self._current = self._units.popleft()
                    continue
                item, self._since = self._current[0], time.monotonic()
            try:
                self._deliver(item)
            except Exception as exc:  # a tracker must never stop training
                with self._cond:
                    self._since = None
                    self._units.appendleft(self._current)
                    self._current, again, self.down = None, self.down, True
                    dropped = self._trim(self.limit)
                self._failed(item, exc, again)
                self._report(dropped)
                return
            with self._cond:
                self._since = None
                self._current.pop(0)
        if recovered:
            self._recovered()


def pending_gates(items: list[Item]) -> list[Any]:
    """The gate records among queued calls, in order.

    >>> pending_gates([("log_gate", ({"step": 3}, {}, 3)), ("alert", ({"step": 3},))])
    [{'step': 3}]
    """
    return [args[0] for method, args in items if method == "log_gate"]
