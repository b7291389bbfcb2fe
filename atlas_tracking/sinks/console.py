"""Gates and alerts in the Python log: one summary line per gate, opening with its verdict and the part that raised
it (:func:`~atlas_tracking.schema.verdict.gate_verdict`), then the receipt-level status and the stage."""

from __future__ import annotations

import logging
from typing import Any

from atlas_tracking.receipts.param_drift import drift_line
from atlas_tracking.schema.verdict import gate_verdict
from atlas_tracking.viz.tables import summary_line

log = logging.getLogger("atlas_tracking")


class LoggingSink:
    """A one-line gate summary (and alerts) through Python logging, e.g. Lightning's console."""

    name = "console"

    def __init__(self, logger: logging.Logger | None = None):
        self.logger = logger or log

    def log_gate(self, record: dict[str, Any], metrics: dict[str, float], step: int) -> None:
        self.logger.info(
            "atlas gate step=%s verdict=%s status=%s stage=%s %s", record.get("step", step),
            gate_verdict(record).headline(), record.get("status", "-"), record.get("stage", "-"), summary_line(record),
        )
        if record.get("param_drift"):
            self.logger.info("atlas gate step=%s %s", record.get("step", step), drift_line(record["param_drift"]))

    def alert(self, event: dict[str, Any]) -> None:
        level = {"INFO": logging.INFO, "WARN": logging.WARNING, "ERROR": logging.ERROR}.get(event.get("level"), 20)
        self.logger.log(level, "atlas alert [%s] %s: %s", event.get("level"), event.get("title"), event.get("text"))

    def finish(self) -> None:
        return None
