"""The sink protocol: what a tracker needs to receive gates and alerts."""

from __future__ import annotations

from typing import Any, Protocol


class Sink(Protocol):
    """A tracker or notifier that receives gates and alerts."""

    name: str

    def log_gate(self, record: dict[str, Any], metrics: dict[str, float], step: int) -> None: ...

    def alert(self, event: dict[str, Any]) -> None: ...

    def finish(self) -> None: ...


class LoadSink(Sink, Protocol):
    """A sink that also receives the training-batch load of each logging interval between gates (optional)."""

    def log_load(self, line: dict[str, Any], metrics: dict[str, float], step: int, picture: bool) -> None: ...


def tracker_run(sink: Any) -> str | None:
    """The tracker run a sink writes to (None for sinks without one, or when it cannot be reached)."""
    try:
        run = getattr(sink, "run_key", None)
    except Exception:  # a tracker that is down
        return None
    return None if run is None else str(run)
