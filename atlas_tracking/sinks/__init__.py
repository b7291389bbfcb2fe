"""Where records go: the local record first, then trackers, never fatally.

``base`` (the sink protocol), ``delivery`` (fan-out, bounded backlog, catch-up after a restart), ``jsonl``
(the local record as a sink), ``console`` (the Python log), ``webhook`` (alerts as JSON),
``metrics_logger`` (scalars for any logger with ``log_metrics``) and ``figures`` (tracker figures that never
cost the scalars). Tracker sinks (W&B, MLflow) live in ``atlas_tracking.integrations``.
"""

from atlas_tracking.sinks.base import Sink
from atlas_tracking.sinks.console import LoggingSink
from atlas_tracking.sinks.delivery import Delivery
from atlas_tracking.sinks.jsonl import JsonlSink
from atlas_tracking.sinks.metrics_logger import LogMetricsSink
from atlas_tracking.sinks.webhook import WebhookSink

__all__ = ["Delivery", "JsonlSink", "LogMetricsSink", "LoggingSink", "Sink", "WebhookSink"]
