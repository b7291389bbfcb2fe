"""MLflow, read back from a real server: tags short enough to read (the long text in the HTML report and the alerts
table), the verdict tag and the plotted ``atlas/verdict_code`` agreeing with the report's headline, the coded
metrics' legends as params, and a gate that could not run plotted and tagged FAILED.

The gates are the policy's own Table 3 sequence (Distill-640): status YELLOW in ``intervene`` with an ERROR alert.
"""

from __future__ import annotations

import re
from pathlib import Path

from atlas_tracking.integrations.mlflow import ALERTS_TABLE, REPORT, TAG_CHARS, MlflowSink
from mlflow.tracking import MlflowClient

from atlas_tracking.artifacts.record import gate_metrics
from atlas_tracking.decisions.alerts import AlertEngine
from atlas_tracking.decisions.policy import GatePolicy, GateSummary
from atlas_tracking.schema.verdict import LEVEL_CODES, code_legends, gate_verdict
from atlas_tracking.sinks.delivery import Delivery
from atlas_tracking.sinks.jsonl import JsonlSink

TABLE3 = [(0, .083, 42, 3.00, 140, None), (500, -.027, 285, 2.32, 190, 4.73), (1000, -.020, 285, 2.32, 190, 4.53),
          (1500, -.042, 300, 2.25, 194, 4.48), (2000, -.063, 300, 2.25, 205, 4.48)]


def test_tags_are_short_and_agree_with_the_plotted_code_the_report_and_the_alerts_table(tmp_path, mlflow_server):
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run_id = client.create_run(client.create_experiment("verdict")).info.run_id
    sink = MlflowSink(client=client, run_id=run_id, figures=False, report_every_s=0)  # the report at every gate
    delivery = Delivery(JsonlSink(tmp_path / "gates.jsonl"), [sink])
    policy, alerts, records = GatePolicy(), AlertEngine(), []
    for row in TABLE3:
        summary = GateSummary(*row)
        record = {**summary.to_dict(), **policy.read(summary).to_dict(), "layers": []}
        record["alerts"] = [e.to_dict() for e in alerts.evaluate(record, record)]
        delivery.gate(record, gate_metrics(record), record["step"], record["alerts"])
        records.append(record)
    delivery.wait(120)
    run = client.get_run(run_id)
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("atlas.")}
    verdict = gate_verdict(records[-1])
    assert (tags["atlas.verdict"], tags["atlas.verdict.source"]) == ("RED", "stage intervene") == (
        verdict.level, verdict.source)
    assert tags["atlas.action"] == "Intervene or stop claiming progress"
    assert all(len(v) <= TAG_CHARS for v in tags.values()), {k: len(v) for k, v in tags.items()}
    # the plotted verdict code follows the tag at every gate; the status code stays the receipt status
    plotted = [m.value for m in sorted(client.get_metric_history(run_id, "atlas/verdict_code"), key=lambda m: m.step)]
    assert plotted == [float(gate_verdict(r).code) for r in records] and plotted[-1] == LEVEL_CODES["RED"]
    assert client.get_metric_history(run_id, "atlas/status_code")[-1].value == 2.0
    # the legends of the coded metrics are params
    assert {k: run.data.params[f"atlas.legend.{k.removeprefix('atlas/')}"] for k in code_legends()} == code_legends()
    # the HTML report at the last gate opens with the same verdict and holds the full action
    (tmp_path / "dl").mkdir()
    page = Path(client.download_artifacts(run_id, REPORT, str(tmp_path / "dl"))).read_text()
    opening = page.split("<h2")[0]
    assert '">RED</span> raised by <b>stage intervene</b>' in opening and "status YELLOW" in opening
    assert records[-1]["action"] in page
    # alerts as a readable table: one row per alert, with the gate's verdict
    table = Path(client.download_artifacts(run_id, ALERTS_TABLE, str(tmp_path / "dl"))).read_text()
    rows = re.findall(r"<tr><td>(\d+)</td><td>(\w+)</td><td>([^<]*)</td><td>([^<]*)</td>", table)
    assert [(int(s), lvl, verdict_text) for s, lvl, _, verdict_text in rows] == [
        (a["step"], a["level"], gate_verdict(r).headline()) for r in records for a in r["alerts"]]
    assert rows[-1][1:] == ("ERROR", "atlas: intervene at step 2000", "RED (stage intervene)")


def test_a_gate_that_could_not_run_is_tagged_and_plotted_failed(tmp_path, mlflow_server):
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run_id = client.create_run(client.create_experiment("failed")).info.run_id
    sink = MlflowSink(client=client, run_id=run_id, figures=False, report=False)
    engine = AlertEngine()
    error = "RouterLogitsError: NaN/Inf router logits in model.layers.1.mlp at step 20; " + "the rest " * 20
    sink.alert(engine.failure(20, error, ["model.layers.1.mlp"]).to_dict())
    tags = client.get_run(run_id).data.tags
    assert (tags["atlas.verdict"], tags["atlas.verdict.source"]) == ("FAILED", "gate failed")
    assert tags["atlas.failed.error"].startswith("RouterLogitsError: NaN/Inf") and len(tags["atlas.failed.error"]) \
        <= TAG_CHARS
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "atlas/verdict_code")] == [
        (20, float(LEVEL_CODES["FAILED"]))]
    table = Path(client.download_artifacts(run_id, ALERTS_TABLE, str(tmp_path))).read_text()
    assert error.split(";")[0] in table and "FAILED (gate failed)" in table


def test_gates_closer_than_report_every_s_share_one_report_and_the_end_of_training_writes_the_last(tmp_path,
                                                                                                    mlflow_server):
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run_id = client.create_run(client.create_experiment("report")).info.run_id
    sink = MlflowSink(client=client, run_id=run_id, figures=False, report_every_s=3600)
    delivery = Delivery(JsonlSink(tmp_path / "gates.jsonl"), [sink])
    policy = GatePolicy()
    for row in TABLE3[:3]:
        record = {**GateSummary(*row).to_dict(), **policy.read(GateSummary(*row)).to_dict(), "layers": []}
        delivery.gate(record, gate_metrics(record), record["step"], [])
    delivery.wait(120)

    def report_steps(name: str) -> list[str]:
        (tmp_path / name).mkdir()
        page = Path(client.download_artifacts(run_id, REPORT, str(tmp_path / name))).read_text()
        return [str(row[0]) for row in TABLE3[:3] if f"step {row[0]}" in page]

    first = report_steps("during")
    assert "0" in first and "1000" not in first  # only the first gate's upload happened within the hour
    assert delivery.finish() == {"mlflow": []}
    assert "1000" in report_steps("after")  # the end of training rewrote it with every gate
