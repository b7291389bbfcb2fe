"""Where gate records and alerts go: the local JSONL record first, then trackers, never fatally.

A sink has a ``name``, ``log_gate(record, metrics, step)``, ``alert(event)`` and ``finish()``
(accelerate's tracker shape). :class:`Delivery` fans a gate out: it appends the record to
``atlas/gates.jsonl`` before anything else, then calls every sink inside a guard. A sink that
fails (a tracker server down, a network error) produces one warning naming what was not
delivered; its calls are kept in a bounded backlog and replayed, in order, at the next gate,
so delivery resumes when the service is back. Training never dies because monitoring failed.

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

log = logging.getLogger("atlas_tracking")


class Sink(Protocol):
    """A tracker or notifier that receives gates and alerts."""

    name: str

    def log_gate(self, record: dict[str, Any], metrics: dict[str, float], step: int) -> None: ...

    def alert(self, event: dict[str, Any]) -> None: ...

    def finish(self) -> None: ...


class JsonlSink:
    """The local record: one JSON line per gate, appended and flushed (fsync) before any tracker call."""

    name = "jsonl"

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def records(self) -> list[dict[str, Any]]:
        """Every complete record in the file (a torn last line from a crash is skipped)."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                out.append(rec)
        return out

    def log_gate(self, record: dict[str, Any], metrics: dict[str, float], step: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(record, allow_nan=False, separators=(",", ":"))
        with open(self.path, "a") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def alert(self, event: dict[str, Any]) -> None:
        alerts = self.path.with_name("alerts.jsonl")
        with open(alerts, "a") as fh:
            fh.write(json.dumps(event, allow_nan=False, separators=(",", ":")) + "\n")

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
            step, record.get("status", "-"), record.get("stage", "-"), summary_line(record),
        )

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


class Delivery:
    """Local record first, then every sink, each guarded with a replaying backlog."""

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
        self._backlog: dict[str, deque] = {s.name: deque(maxlen=backlog_limit) for s in self.sinks}
        self._down: set[str] = set()

    def add(self, sink: Any) -> None:
        """Deliver to one more sink from the next call on (no-op if a sink of that name is present)."""
        if sink.name in self._backlog:
            return
        self.sinks.append(sink)
        self._backlog[sink.name] = deque(maxlen=self.backlog_limit)

    def backlog_size(self, name: str) -> int:
        return len(self._backlog.get(name, ()))

    def _call(self, sink: Any, method: str, args: tuple) -> None:
        queue = self._backlog[sink.name]
        queue.append((method, args))
        while queue:
            m, a = queue[0]
            try:
                getattr(sink, m)(*a)
            except Exception as exc:  # a tracker must never stop training
                if sink.name not in self._down:
                    self._down.add(sink.name)
                    what = f"gate step {a[2]}" if m == "log_gate" else f"alert {a[0].get('title')!r}"
                    self.warn(
                        f"atlas: {sink.name} did not receive {what} ({type(exc).__name__}: {str(exc)[:200]}); "
                        f"kept locally, {len(queue)} item(s) queued for retry at the next gate"
                    )
                return
            queue.popleft()
        if sink.name in self._down:
            self._down.discard(sink.name)
            self.warn(f"atlas: {sink.name} is reachable again; queued gates and alerts were delivered")

    def gate(self, record: dict[str, Any], metrics: dict[str, float], step: int) -> None:
        if self.local is not None:
            self.local.log_gate(record, metrics, step)
        for sink in self.sinks:
            self._call(sink, "log_gate", (record, metrics, step))

    def alert(self, event: dict[str, Any]) -> None:
        if self.local is not None:
            self.local.alert(event)
        for sink in self.sinks:
            self._call(sink, "alert", (event,))

    def finish(self) -> None:
        for sink in self.sinks:
            try:
                sink.finish()
            except Exception as exc:
                self.warn(f"atlas: {sink.name} failed to finish ({type(exc).__name__})")
