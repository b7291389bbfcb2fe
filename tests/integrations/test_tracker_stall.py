"""A real MLflow client whose tracking server accepts connections and never answers (a TCP server on
127.0.0.1, MLflow's default timeout and retries): the gates run at their own pace (each gate's time beyond its own
``gate_seconds`` is bounded), the end of training waits only ``gate.delivery_wait_s`` (``finish()`` is timed), and
every gate the tracker lacks is reported and stays listed."""

from __future__ import annotations

import json
import time

from atlas_tracking.integrations.mlflow import MlflowSink

from atlas_tracking.cli import main
from atlas_tracking.gate import AtlasGate
from atlas_tracking.testing.silent_server import SilentServer
from atlas_tracking.testing.tiny import QUIET, tiny_canary, tiny_module


def test_a_tracker_that_never_answers_does_not_hold_the_gates(tmp_path, monkeypatch, capsys):
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)  # MLflow's defaults: minutes of retries per call
    out, told = tmp_path / "atlas", []
    with SilentServer() as server:
        sink = MlflowSink(tracking_uri=server.uri, run_id="never-answers", figures=False)
        gate = AtlasGate(tiny_module().model, tiny_canary(), {**QUIET, "gate": {"delivery_wait_s": 1.0}},
                         out_dir=out, sinks=[sink])
        gate.delivery.warn = told.append
        beyond = []  # each gate's wall time beyond its own measurement and reading (gate_seconds)
        for step, loss in [(0, 5.0), (10, 4.9), (20, 4.8)]:
            t0 = time.monotonic()
            record = gate.run(step, loss=loss)
            beyond.append(time.monotonic() - t0 - record["gate_seconds"])
        t0 = time.monotonic()
        gate.finish()
        finish_s = time.monotonic() - t0
        assert server.accepted >= 1  # the client did reach the server, which never answered
    # one synchronous MLflow call against this server alone takes its 120 s timeout: a gate that waited for the
    # tracker at all would take that long; writing the record and the receipts takes a fraction of a second
    assert max(beyond) < 1.0, beyond
    # the end of training waits delivery_wait_s (1 s) at most, then writes backlog.json
    assert finish_s < 1.0 + 1.0, finish_s
    assert [json.loads(line)["step"] for line in (out / "gates.jsonl").read_text().splitlines()] == [0, 10, 20]
    assert not (out / "delivered.jsonl").exists()
    waiting = json.loads((out / "backlog.json").read_text())["sinks"]
    assert waiting == {"mlflow": {"run": "never-answers", "steps": [[0, gate.branch], [10, gate.branch],
                                                                     [20, gate.branch]]}}
    assert any(m.startswith("atlas: 3 gate(s) did not reach mlflow by the end of training") for m in told)
    assert main(["gates", str(out)]) == 0
    assert "not yet delivered: mlflow (run never-answers): 3 gate(s), steps 0, 10, 20" in capsys.readouterr().out
