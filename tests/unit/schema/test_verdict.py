"""One verdict per gate, the same on every local surface: the plotted code, the console line, the ``gates`` table,
the report's badge and headline, and the webhook's body (a real HTTP server on 127.0.0.1). The trackers' tags are
read back in tests/integrations/test_mlflow_verdict.py and tests/integrations/test_trackers.py.

The gate is the GRPO run's last one: status YELLOW, stage ``intervene``, an ERROR alert. Its report opened "RED
step 12 YELLOW, stage intervene" while ``atlas/status_code`` plotted 2.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from atlas_tracking.artifacts.record import gate_metrics
from atlas_tracking.schema.verdict import LEVEL_CODES, LEVELS, code_legends, gate_verdict, raised_parts
from atlas_tracking.sinks.console import LoggingSink
from atlas_tracking.sinks.webhook import WebhookSink
from atlas_tracking.viz.gate_table import HEADER, gate_table
from atlas_tracking.viz.html_report import opening

GRPO = {"step": 12, "status": "YELLOW", "stage": "intervene", "c2_trend": "stable", "occupancy": "degrading",
        "loss_trend": "stalling", "rule": "Table 13 row 3: two subsequent worse gates with the same occupancy pathology",
        "action": "Intervene or stop claiming progress: repeated degradation.", "c2": 0.1, "layers": [],
        "alerts": [{"level": "ERROR", "title": "atlas: intervene at step 12", "text": "Intervene."}]}


def test_the_verdict_names_its_level_and_the_part_that_raised_it():
    v = gate_verdict(GRPO)
    assert (v.level, v.source, v.reason) == ("RED", "stage intervene", GRPO["rule"])
    assert [(p.level, p.source) for p in v.parts] == [("YELLOW", "status YELLOW"), ("RED", "stage intervene"),
                                                      ("RED", "alert ERROR")]
    # each part alone raises its own level; nothing raised: the status
    assert gate_verdict({"status": "GREEN", "stage": "clean", "alerts": [{"level": "WARN", "title": "t"}]}).headline() \
        == "YELLOW (alert WARN)"
    assert gate_verdict({"status": "GREEN", "stage": "clean",
                         "predicates": {"base_damage": {"verdict": "fail", "reason": "r"}}}).headline() \
        == "YELLOW (predicate base_damage)"
    assert gate_verdict({"status": "RED", "stage": "revoked"}).headline() == "RED"
    assert gate_verdict({"status": "BASELINE", "stage": "baseline", "alerts": [{"level": "INFO"}]}).level == "BASELINE"
    assert raised_parts({"status": "GREEN", "stage": "recovering"}) == []


def test_every_local_surface_shows_the_one_verdict(caplog):
    v = gate_verdict(GRPO)
    metrics = gate_metrics(GRPO)
    assert (metrics["atlas/verdict_code"], metrics["atlas/status_code"]) == (LEVEL_CODES["RED"], 2.0)
    assert code_legends()["atlas/verdict_code"].split(", ")[int(metrics["atlas/verdict_code"])] == "3 RED"

    with caplog.at_level(logging.INFO, logger="atlas_tracking"):
        LoggingSink().log_gate(GRPO, metrics, 12)
    assert "verdict=RED (stage intervene) status=YELLOW stage=intervene" in caplog.records[0].getMessage()

    header, _, row = gate_table([GRPO]).splitlines()
    at = header.index("verdict")
    assert HEADER.index("verdict") < HEADER.index("status") and row[at:].startswith("RED (stage intervene)  YELLOW")

    head = opening(GRPO, [])
    assert '">RED</span> raised by <b>stage intervene</b>: Table 13 row 3' in head
    assert "status YELLOW, stage intervene" in head and v.level == "RED"


@pytest.fixture
def webhook_server():
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            return None

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/hook", received
    server.shutdown()


def test_the_webhook_body_carries_the_gate_verdict_and_a_failure_is_failed(webhook_server):
    url, received = webhook_server
    sink = WebhookSink(url)
    sink.log_gate(GRPO, gate_metrics(GRPO), 12)
    sink.alert({**GRPO["alerts"][0], "key": "stage:intervene", "step": 12, "wait_duration_s": 1.0})
    sink.alert({"title": "atlas: gate failed at step 20", "text": "t", "level": "ERROR", "key": "gate_failed",
                "step": 20, "wait_duration_s": 1.0, "failed": {"count": 1, "first_step": 20, "last_step": 20,
                                                              "layers": [], "error": "RouterLogitsError: NaN"}})
    assert [r["verdict"]["level"] for r in received] == ["RED", "FAILED"]
    assert received[0]["verdict"] == {"level": "RED", "code": 3, "source": "stage intervene", "reason": GRPO["rule"]}
    assert received[1]["verdict"]["reason"] == "RouterLogitsError: NaN" and LEVELS[received[1]["verdict"]["code"]] \
        == "FAILED"
