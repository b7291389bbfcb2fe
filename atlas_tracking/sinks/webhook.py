"""Alerts POSTed as JSON to a webhook whose URL is never logged; each event carries its gate's ``verdict`` (level,
code, source, reason: :func:`~atlas_tracking.schema.verdict.gate_verdict`)."""

from __future__ import annotations

import json
import os
import urllib.request
from typing import Any

from atlas_tracking.schema.verdict import Verdict, failed_event_verdict, gate_verdict


class WebhookSink:
    """POSTs alert events as JSON to a webhook URL. The URL is a secret: it is never logged or shown."""

    name = "webhook"

    def __init__(self, url: str, timeout_s: float = 5.0):
        if not url.startswith(("https://", "http://")):
            raise ValueError("webhook URL must start with http:// or https:// (the URL itself is not shown)")
        self._url = url
        self.timeout_s = timeout_s
        self._verdict: Verdict | None = None
        """The verdict of the last gate (its alerts follow it)."""

    def __repr__(self) -> str:
        return "WebhookSink(url=<hidden>)"

    @classmethod
    def from_config(cls, url: str, env_var: str) -> WebhookSink | None:
        """The URL from ``env_var`` when set, else ``url``; None when neither is given."""
        chosen = os.environ.get(env_var) or url
        return cls(chosen) if chosen else None

    def log_gate(self, record: dict[str, Any], metrics: dict[str, float], step: int) -> None:
        self._verdict = gate_verdict(record)

    def alert(self, event: dict[str, Any]) -> None:
        verdict = failed_event_verdict(event) or self._verdict
        body = json.dumps({**event, "verdict": verdict.to_dict() if verdict else None}, allow_nan=False).encode()
        req = urllib.request.Request(self._url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                resp.read()
        except OSError as exc:
            # the message of a URL error can carry the URL; report the failure without it
            raise ConnectionError(f"webhook delivery failed ({type(exc).__name__})") from None

    def finish(self) -> None:
        return None
