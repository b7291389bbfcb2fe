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

import json
import logging
import os
import urllib.request
import warnings
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from atlas_tracking.history import ALERTS, DELIVERED, RunDir, append_line, key, read_history

log = logging.getLogger("atlas_tracking")


class Sink(Protocol):
    """A tracker or notifier that receives gates and alerts."""

    name: str

    def log_gate(self, record: dict[str, Any], metrics: dict[str, float], step: int) -> None: ...

    def alert(self, event: dict[str, Any]) -> None: ...

    def finish(self) -> None: ...


class JsonlSink:
    """The local record: one JSON line per gate, appended with one write and fsynced before any tracker call.

    Alerts go to ``alerts.jsonl`` and tracker acknowledgements to ``delivered.jsonl`` beside it.
    """

    name = "jsonl"

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def records(self) -> list[dict[str, Any]]:
        """The history in the file (see :func:`atlas_tracking.history.read_history`)."""
        return read_history(self.path) if self.path.exists() else []

    def log_gate(self, record: dict[str, Any], metrics: dict[str, float], step: int) -> None:
        append_line(self.path, record)

    def alert(self, event: dict[str, Any]) -> None:
        append_line(self.path.with_name(ALERTS), event)

    def acknowledge(self, sink: str, run: str, record: dict[str, Any]) -> None:
        """Note that tracker run ``run`` of ``sink`` holds this gate and its alerts."""
        step, branch = key(record)
        append_line(self.path.with_name(DELIVERED), {"step": step, "branch": branch, "sink": sink, "run": run})

    def delivered(self, sink: str, run: str) -> set[tuple[int, str | None]]:
        return RunDir(self.path.parent).delivered_keys(sink, run)

    def finish(self) -> None:
        return None


class LoggingSink:
    """A one-line gate summary (and alerts) through Python logging, e.g. Lightning's console."""

    name = "console"

    def __init__(self, logger: logging.Logger | None = None):
        self.logger = logger or log

    def log_gate(self, record: dict[str, Any], metrics: dict[str, float], step: int) -> None:
        from atlas_tracking.tables import summary_line

        self.logger.info(
            "atlas gate step=%s status=%s stage=%s %s",
            record.get("step", step), record.get("status", "-"), record.get("stage", "-"), summary_line(record),
        )
        if record.get("param_drift"):
            from atlas_tracking.receipts.param_drift import drift_line

            self.logger.info("atlas gate step=%s %s", record.get("step", step), drift_line(record["param_drift"]))

    def alert(self, event: dict[str, Any]) -> None:
        level = {"INFO": logging.INFO, "WARN": logging.WARNING, "ERROR": logging.ERROR}.get(event.get("level"), 20)
        self.logger.log(level, "atlas alert [%s] %s: %s", event.get("level"), event.get("title"), event.get("text"))

    def finish(self) -> None:
        return None


class WebhookSink:
    """POSTs alert events as JSON to a webhook URL. The URL is a secret: it is never logged or shown."""

    name = "webhook"

    def __init__(self, url: str, timeout_s: float = 5.0):
        if not url.startswith(("https://", "http://")):
            raise ValueError("webhook URL must start with http:// or https:// (the URL itself is not shown)")
        self._url = url
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return "WebhookSink(url=<hidden>)"

    @classmethod
    def from_config(cls, url: str, env_var: str) -> WebhookSink | None:
        """The URL from ``env_var`` when set, else ``url``; None when neither is given."""
        chosen = os.environ.get(env_var) or url
        return cls(chosen) if chosen else None

    def log_gate(self, record: dict[str, Any], metrics: dict[str, float], step: int) -> None:
        return None

    def alert(self, event: dict[str, Any]) -> None:
        body = json.dumps(event, allow_nan=False).encode()
        req = urllib.request.Request(self._url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                resp.read()
        except OSError as exc:
            # the message of a URL error can carry the URL; report the failure without it
            raise ConnectionError(f"webhook delivery failed ({type(exc).__name__})") from None

    def finish(self) -> None:
        return None


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


def tracker_run(sink: Any) -> str | None:
    """The tracker run a sink writes to (None for sinks without one, or when it cannot be reached)."""
    try:
        run = getattr(sink, "run_key", None)
    except Exception:  # a tracker that is down
        return None
    return None if run is None else str(run)


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
