"""Scalar receipts for any logger with ``log_metrics(metrics, step)``.

A Lightning ``TensorBoardLogger``, ``CSVLogger`` or any other ``Logger`` without a sink of its own
receives the same ``atlas/*`` scalars W&B and MLflow do, at the step the gate is delivered at (for
Lightning, the step ``val_loss`` is logged at). Such a logger has no place for alerts and no run
identity, so alerts are not sent to it and a resume does not send it the gates it missed.

Example:
    >>> class Printer:
    ...     def log_metrics(self, metrics, step=None): print(step, metrics)
    >>> sink = LogMetricsSink(Printer())
    >>> sink.name
    'Printer'
    >>> sink.log_gate({"step": 10, "status": "GREEN"}, {"atlas/c2": 0.5}, step=9)
    9 {'atlas/c2': 0.5}
"""

from __future__ import annotations

from typing import Any


class LogMetricsSink:
    """Deliver a gate's scalar metrics through ``logger.log_metrics(metrics, step=step)``.

    Args:
        logger: the logger (anything with ``log_metrics``).
        name: the sink's name in warnings and backlogs (default: the logger's class name).
    """

    def __init__(self, logger: Any, name: str | None = None):
        self.logger = logger
        self.name = name or type(logger).__name__

    def log_gate(self, record: dict[str, Any], metrics: dict[str, float], step: int) -> None:
        self.logger.log_metrics(dict(metrics), step=int(step))

    def log_load(self, line: dict[str, Any], metrics: dict[str, float], step: int, picture: bool) -> None:
        """The interval's bounded scalars (``atlas/train/...``); the picture and table go to trackers that hold
        them."""
        self.logger.log_metrics(dict(metrics), step=int(step))

    def log_rollout(self, line: dict[str, Any], metrics: dict[str, float], step: int) -> None:
        """A recorded step's rollout-agreement scalars (``atlas/rollout/...``)."""
        self.logger.log_metrics(dict(metrics), step=int(step))

    def alert(self, event: dict[str, Any]) -> None:
        """Alerts stay in the local record and the trackers that have a place for them."""
        return None

    def finish(self) -> None:
        """Nothing to close: the logger belongs to the training framework."""
        return None
