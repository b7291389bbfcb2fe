"""Trackers with real components: W&B offline files read back with wandb's records, a real MLflow server
on 127.0.0.1 with sqlite, tracker faults that never stop training, and the exact metric keys of one gate."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
from atlas_tracking.integrations.lightning import AtlasCallback

from atlas_tracking.artifacts.record import gate_metrics
from atlas_tracking.schema.verdict import gate_verdict
from atlas_tracking.testing.tiny import QUIET, tiny_canary, tiny_data, tiny_module

STRICT = {**QUIET, "policy": {"phase": "post_training", "c2_tol": 0.0, "dead_tol": 0.0, "entropy_tol": 0.0, "cv_tol": 0.0, "use_ci": False}}
"""Zero tolerances: the first post-baseline gate reads bad, so the run enters revoked (an alert)."""


@pytest.fixture(autouse=True)
def _offline_env(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


def _fit(tmp_path, loggers, steps=30, config=STRICT, extra=()):
    train, val = tiny_data(steps)
    trainer = pl.Trainer(
        max_steps=steps, val_check_interval=10, check_val_every_n_epoch=None, logger=loggers,
        default_root_dir=str(tmp_path), callbacks=[AtlasCallback(canary=tiny_canary(), config=config), *extra],
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu",
        devices=1, enable_checkpointing=False, log_every_n_steps=5,
    )
    trainer.fit(tiny_module(), train, val)
    return trainer


def _records(tmp_path):
    return [json.loads(line) for line in (tmp_path / "atlas" / "gates.jsonl").read_text().splitlines()]


# --- W&B -------------------------------------------------------------------------------------


def test_wandb_offline_fit_is_read_back_with_wandb_records(tmp_path, recwarn):
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    from atlas_tracking.testing.wandb_offline import wait_for_offline_run

    logger = WandbLogger(project="atlas-test", save_dir=str(tmp_path), offline=True)
    _fit(tmp_path, [logger])
    undelivered = [str(w.message) for w in recwarn if "did not receive" in str(w.message)]
    assert undelivered == []
    run_dir = Path(logger.experiment.dir).parent
    wandb.finish()
    data = wait_for_offline_run(run_dir)
    assert data["complete"]
    records = _records(tmp_path)
    atlas_rows = [row for row in data["history"] if "atlas/c2" in row]
    assert [r["step"] for r in records] == [0, 10, 20, 30]
    # gates land at the step Lightning logs val_loss at (its count of batches that stepped), not one after
    val_steps = [row["trainer/global_step"] for row in data["history"] if "val_loss" in row]
    assert [row["trainer/global_step"] for row in atlas_rows] == [r["log_step"] for r in records] == [0, *val_steps]
    assert val_steps == [9, 19, 29]
    for row, rec in zip(atlas_rows, records):
        assert row["atlas/c2"] == pytest.approx(rec["c2"])
        assert row["atlas/status_code"] == {"BASELINE": 0, "GREEN": 1, "YELLOW": 2, "RED": 3}[rec["status"]]
        assert row["atlas/layer_00/dead_experts"] == rec["layers"][0]["dead_experts"]
        assert row["atlas/layers"]["_type"] == "table-file" and row["atlas/c2_heatmap"]["_type"] == "image-file"
        assert row["atlas/c2_by_layer_table"]["_type"] == "table-file"
        assert row["atlas/expert_load"]["_type"] == "image-file"
        table = json.loads((run_dir / "files" / row["atlas/experts"]["path"]).read_text())
        expected = [[f"layer {lay['index']}", e, n] for lay in rec["layers"] for e, n in enumerate(lay["expert_load"])]
        columns = [table["columns"].index(c) for c in ("layer", "expert", "load")]
        assert [[r[c] for c in columns] for r in table["data"]] == expected
        dead = table["columns"].index("dead")
        assert sum(r[dead] for r in table["data"]) == sum(lay["dead_experts"] for lay in rec["layers"])
        if rec["status"] != "BASELINE":  # the change of each share since the baseline
            delta = table["columns"].index("share_delta")
            assert all(isinstance(r[delta], float) for r in table["data"])
    for row, rec in zip(atlas_rows[1:], records[1:]):  # parameter drift beside the atlas drift
        assert row["atlas/param_drift/total"] == pytest.approx(rec["param_drift"]["total"]["relative_distance"])
        assert row["atlas/param_drift/experts_moved"] == rec["param_drift"]["groups"]["experts"]["moved"] > 0
    revoked = [a for a in data["alerts"] if "revoked" in a["title"]]
    assert records[1]["stage"] == "revoked" and len(revoked) == 1 and revoked[0]["level"] == "WARN"
    assert data["summary"]["atlas/stage"] == records[-1]["stage"]
    assert data["summary"]["atlas/last_gate_step"] == records[-1]["step"] == 30  # the record's step, not 29


def test_wandb_failure_does_not_stop_training_and_is_warned(tmp_path):
    import wandb
    from atlas_tracking.integrations.wandb import WandbSink

    run = wandb.init(project="atlas-test", dir=str(tmp_path), mode="offline")
    run.finish()  # every later call on this run fails (wandb raises UsageError)
    train, val = tiny_data(20)
    trainer = pl.Trainer(
        max_steps=20, val_check_interval=10, check_val_every_n_epoch=None, logger=False, default_root_dir=str(tmp_path),
        callbacks=[AtlasCallback(canary=tiny_canary(), config=QUIET, sinks=[WandbSink(run=run)])],
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1,
        enable_checkpointing=False,
    )
    with pytest.warns(UserWarning, match="atlas: wandb did not receive gate step 0"):
        trainer.fit(tiny_module(), train, val)
    assert trainer.global_step == 20
    assert [r["step"] for r in _records(tmp_path)] == [0, 10, 20]


# --- MLflow ----------------------------------------------------------------------------------


def test_mlflow_server_fit_metrics_tags_artifacts(tmp_path, mlflow_server):
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    logger = MLFlowLogger(experiment_name="atlas-test", tracking_uri=mlflow_server.uri)
    _fit(tmp_path, [logger])
    records = _records(tmp_path)
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run = client.get_run(logger.run_id)
    hist = client.get_metric_history(logger.run_id, "atlas/c2")
    assert sorted((m.step, round(m.value, 9)) for m in hist) == [(r["log_step"], round(r["c2"], 9)) for r in records]
    val_steps = sorted(m.step for m in client.get_metric_history(logger.run_id, "val_loss"))
    assert val_steps == [r["log_step"] for r in records[1:]] == [9, 19, 29]
    assert run.data.tags["atlas.verdict"] == gate_verdict(records[-1]).level
    assert run.data.tags["atlas.stage"] == records[-1]["stage"]
    assert run.data.tags["atlas.alert.title"].startswith("atlas:")
    gates = {a.path for a in client.list_artifacts(logger.run_id, "atlas/gates")}
    assert gates == {f"atlas/gates/step_{r['step']:08d}.json" for r in records}
    figures = {a.path for a in client.list_artifacts(logger.run_id, "atlas/figures")}
    # the training-batch load's pictures go beside them (tests/integrations/test_tracker_load.py reads those)
    figures = {f for f in figures if not f.startswith("atlas/figures/train_expert_load_")}
    # one step number: files and tags carry the record's step (metrics alone sit at Lightning's logger step)
    assert figures == {"atlas/figures/c2_heatmap.png", *(f"atlas/figures/c2_by_layer_{r['step']:08d}.png"
                                                         for r in records),
                       *(f"atlas/figures/expert_load_{r['step']:08d}.png" for r in records)}
    png = Path(client.download_artifacts(logger.run_id, "atlas/figures/expert_load_00000030.png", str(tmp_path / "dl3")))
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert run.data.tags["atlas.last_gate_step"] == str(records[-1]["step"]) == "30"
    local = client.download_artifacts(logger.run_id, "atlas/alerts.jsonl", str(tmp_path / "dl"))
    titles = [json.loads(line)["title"] for line in Path(local).read_text().splitlines()]
    assert any("revoked" in t for t in titles)
    stored = json.loads(Path(client.download_artifacts(logger.run_id, "atlas/gates/step_00000010.json",
                                                       str(tmp_path / "dl2"))).read_text())
    assert stored["stage"] == records[1]["stage"] and stored["c2"] == records[1]["c2"]


def test_mlflow_outage_keeps_local_record_and_delivers_when_back(tmp_path, mlflow_server):
    from atlas_tracking.integrations.mlflow import MlflowSink
    from mlflow.tracking import MlflowClient

    from atlas_tracking.sinks.delivery import Delivery
    from atlas_tracking.sinks.jsonl import JsonlSink

    client = MlflowClient(tracking_uri=mlflow_server.uri)
    exp = client.create_experiment("outage")
    run_id = client.create_run(exp).info.run_id
    warnings: list[str] = []
    delivery = Delivery(JsonlSink(tmp_path / "gates.jsonl"), [MlflowSink(client=client, run_id=run_id)], warn=warnings.append)

    def gate(step, c2):
        record = {"step": step, "c2": c2, "status": "YELLOW", "stage": "revoked", "layers": []}
        delivery.gate(record, gate_metrics(record), step)
        delivery.wait(timeout_s=30.0)  # the sink's background queue, as at the end of training

    gate(1, 0.1)
    mlflow_server.stop()
    gate(2, 0.2)
    delivery.alert({"title": "atlas: run entered revoked at step 2", "text": "t", "level": "WARN", "key": "k",
                    "step": 2, "wait_duration_s": 1.0})
    delivery.wait(timeout_s=30.0)
    assert len(warnings) == 1 and "mlflow did not receive gate step 2" in warnings[0]
    assert delivery.backlog_size("mlflow") == 2
    assert [json.loads(x)["step"] for x in (tmp_path / "gates.jsonl").read_text().splitlines()] == [1, 2]
    mlflow_server.start()
    gate(3, 0.3)
    assert delivery.backlog_size("mlflow") == 0 and "reachable again" in warnings[-1]
    hist = MlflowClient(tracking_uri=mlflow_server.uri).get_metric_history(run_id, "atlas/c2")
    assert sorted((m.step, m.value) for m in hist) == [(1, 0.1), (2, 0.2), (3, 0.3)]
    tags = MlflowClient(tracking_uri=mlflow_server.uri).get_run(run_id).data.tags
    assert tags["atlas.alert.title"] == "atlas: run entered revoked at step 2"


# --- the exact keys of one gate --------------------------------------------------------------


class MockLogger:
    """A mock tracker (named as such): it only records the calls it receives."""

    name = "mock"

    def __init__(self):
        self.calls: list[tuple[str, object]] = []

    def log_gate(self, record, metrics, step):
        self.calls.append(("log_gate", (sorted(metrics), step)))

    def alert(self, event):
        self.calls.append(("alert", event["title"]))

    def finish(self):
        self.calls.append(("finish", None))


def test_mock_logger_receives_exactly_these_keys(tmp_path):
    mock = MockLogger()
    train, val = tiny_data(10)
    trainer = pl.Trainer(
        max_steps=10, val_check_interval=10, check_val_every_n_epoch=None, logger=False, default_root_dir=str(tmp_path),
        callbacks=[AtlasCallback(canary=tiny_canary(), config=QUIET, sinks=[mock])], enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1, enable_checkpointing=False,
    )
    trainer.fit(tiny_module(), train, val)
    layer_keys = [f"atlas/layer_{i:02d}/{k}" for i in (0, 1) for k in
                  ("c2", "dead_experts", "router_entropy", "load_cv", "margin_mean", "ov_cf")]
    summary = ["atlas/c2", "atlas/c2_min", "atlas/c2_protected", "atlas/dead_experts", "atlas/dead_experts_max",
               "atlas/experts_active", "atlas/min_entropy", "atlas/mean_entropy", "atlas/mean_cv_pct", "atlas/max_cv_pct",
               "atlas/margin", "atlas/ov_cf", "atlas/transition_incompat", "atlas/canary_nll",
               "atlas/v2_c1_pass_layers", "atlas/v2_c2_pass_layers", "atlas/status_code", "atlas/stage_code", "atlas/verdict_code",
               "atlas/gate_seconds", "atlas/ov_cf_terminal_jump", "atlas/ov_cf_adjacent_jump",
               "atlas/ov_cf_cliff_off_terminal", "atlas/near_tie_bf16", "atlas/near_tie_bf16_max", "atlas/near_tie_fp16",
               "atlas/near_tie_fp16_max", "atlas/alignment_median", "atlas/alignment_p10_min", "atlas/alignment_negative"]
    baseline_keys = sorted(summary + layer_keys)
    drift_keys = sorted(baseline_keys + ["atlas/loss", "atlas/gate_share", "atlas/handoff_margin", "atlas/refine_margin", "atlas/kl_base",
                                         "atlas/canary_nll_delta", "atlas/comove_state", "atlas/comove_state_against",
                                         "atlas/comove_field", "atlas/comove_router_still"]
                        + [f"atlas/layer_{i:02d}/{k}" for i in (0, 1) for k in ("c2_delta", "boundary_drift")]
                        + [f"atlas/param_drift/{g}{m}" for g in ("router", "experts", "attention", "norms", "embeddings",
                                                                 "total") for m in ("", "_moved")])
    assert mock.calls[0] == ("log_gate", (baseline_keys, 0))
    assert mock.calls[1] == ("log_gate", (drift_keys, 9))  # Lightning logs val_loss of step 10 at step 9
    assert mock.calls[-1] == ("finish", None)


# --- a gate that cannot run is an alarm --------------------------------------------------------


class NanRouter(pl.Callback):
    """Sets the router weight of the second routed layer to NaN for the validations (and so the gates) at
    ``steps``, and restores it afterwards, so training itself stays finite. Listed after the AtlasCallback,
    its ``on_validation_end`` runs after the gate."""

    LAYER = "model.model.layers.1.mlp"

    def __init__(self, steps):
        self.steps, self.saved = set(steps), None

    def on_validation_start(self, trainer, pl_module):
        if trainer.global_step in self.steps:
            weight = pl_module.model.model.layers[1].mlp.gate.weight
            self.saved = weight.detach().clone()
            weight.data.fill_(float("nan"))

    def on_validation_end(self, trainer, pl_module):
        if self.saved is not None:
            pl_module.model.model.layers[1].mlp.gate.weight.data.copy_(self.saved)
            self.saved = None


def _lines(tmp_path, name):
    return [json.loads(line) for line in (tmp_path / "atlas" / name).read_text().splitlines()]


def test_failed_gates_are_an_alarm_in_the_record_wandb_mlflow_and_the_report(tmp_path, mlflow_server, recwarn):
    import wandb
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger
    from mlflow.tracking import MlflowClient

    from atlas_tracking.testing.wandb_offline import wait_for_offline_run
    from atlas_tracking.viz.html_report import write_report

    wandb_logger = WandbLogger(project="atlas-test", save_dir=str(tmp_path), offline=True)
    mlflow_logger = MLFlowLogger(experiment_name="atlas-failed", tracking_uri=mlflow_server.uri)
    trainer = _fit(tmp_path, [wandb_logger, mlflow_logger], extra=[NanRouter({20, 30})])
    assert trainer.global_step == 30  # training went on
    callback = next(c for c in trainer.callbacks if isinstance(c, AtlasCallback))
    records, errors = _records(tmp_path), _lines(tmp_path, "errors.jsonl")
    assert [r["step"] for r in records] == [0, 10]
    assert [(e["step"], e["log_step"], e["consecutive"], e["first_failed_step"]) for e in errors] == [
        (20, 19, 1, 20), (30, 29, 2, 20)]
    assert all(e["failed_layers"] == [NanRouter.LAYER] and e["error"].startswith("RouterLogitsError") for e in errors)
    failed = [a for a in _lines(tmp_path, "alerts.jsonl") if a["key"] == "gate_failed"]
    assert [(a["level"], a["step"], a["failed"]["count"]) for a in failed] == [("ERROR", 20, 1), ("ERROR", 30, 2)]
    assert callback.gate.policy.stage == records[-1]["stage"]  # the policy's state is kept
    assert any("atlas gate at step 20 failed" in str(w.message) for w in recwarn)

    run_dir = Path(wandb_logger.experiment.dir).parent
    wandb.finish()
    data = wait_for_offline_run(run_dir)
    assert [(a["title"], a["level"]) for a in data["alerts"] if "failed" in a["title"]] == [
        ("atlas: gate failed at step 20", "ERROR"), ("atlas: gate failed at step 30", "ERROR")]
    summary = data["summary"]
    assert (summary["atlas/verdict"], summary["atlas/failed_count"], summary["atlas/failed_first_step"],
            summary["atlas/failed_layers"]) == ("FAILED", 2, 20, NanRouter.LAYER)

    tags = MlflowClient(tracking_uri=mlflow_server.uri).get_run(mlflow_logger.run_id).data.tags
    assert (tags["atlas.verdict"], tags["atlas.failed.count"], tags["atlas.failed.first_step"],
            tags["atlas.failed.last_step"], tags["atlas.failed.layers"]) == ("FAILED", "2", "20", "30", NanRouter.LAYER)
    assert tags["atlas.alert.level"] == tags["atlas.alert.max_level"] == "ERROR"
    assert tags["atlas.last_gate_step"] == "10"  # the last gate that ran, at the record's step

    page = write_report(tmp_path / "atlas", tmp_path / "report.html").read_text()
    opening = page.split("<h2>")[0]
    assert ">FAILED</span> Gates failing since step 20: 2 gate(s) could not run" in opening
    assert "step 30: RouterLogitsError" in opening
    assert f'(layers: <span class="layer" title="{NanRouter.LAYER}">layer 1</span>)' in opening  # one name per layer
    assert "Last gate:" not in opening


def test_a_gate_that_runs_again_clears_the_failed_state_and_keeps_the_stage(tmp_path, mlflow_server):
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    from atlas_tracking.viz.html_report import write_report

    logger = MLFlowLogger(experiment_name="atlas-cleared", tracking_uri=mlflow_server.uri)
    _fit(tmp_path, [logger], extra=[NanRouter({10, 20})])
    records, errors = _records(tmp_path), _lines(tmp_path, "errors.jsonl")
    assert [r["step"] for r in records] == [0, 30] and [e["step"] for e in errors] == [10, 20]
    last = records[-1]
    assert last["status"] != "BASELINE" and last["baseline_step"] == 0  # read against the kept baseline
    cleared = last["alerts"][0]
    assert (cleared["level"], cleared["key"], cleared["failed"]["count"]) == ("INFO", "gate_failed_cleared", 2)
    assert "2 gate(s) could not run (steps 10..20" in cleared["text"]
    tags = MlflowClient(tracking_uri=mlflow_server.uri).get_run(logger.run_id).data.tags
    assert tags["atlas.verdict"] == gate_verdict(last).level and (tags["atlas.failed.count"], tags["atlas.failed.cleared_step"]) == (
        "0", "30")
    # the gate at 30 enters revoked (WARN) after the ERRORs: the highest level since the baseline stays beside it
    assert last["stage"] == "revoked" and tags["atlas.alert.level"] == "WARN"
    assert (tags["atlas.alert.max_level"], tags["atlas.alert.max_step"]) == ("ERROR", "10")
    opening = write_report(tmp_path / "atlas", tmp_path / "report.html").read_text().split("<h2>")[0]
    assert "Last gate:" in opening and "Gates failing" not in opening
    assert "2 earlier gate(s) could not run" in opening and "step 10: RouterLogitsError" in opening


def test_an_intervene_gate_with_an_error_alert_is_red_in_the_tags_and_the_report(tmp_path, mlflow_server):
    """The policy's own Table 3 sequence walks to intervene with status YELLOW and an ERROR alert: the verdict tag,
    the plotted verdict code and the report agree on RED raised by the stage, while ``atlas/status_code`` stays the
    receipt status (YELLOW, 2); a WARN after it does not hide the ERROR."""
    from atlas_tracking.integrations.mlflow import MlflowSink
    from mlflow.tracking import MlflowClient

    from atlas_tracking.decisions.alerts import AlertEngine
    from atlas_tracking.decisions.policy import GatePolicy, GateSummary
    from atlas_tracking.sinks.delivery import Delivery
    from atlas_tracking.sinks.jsonl import JsonlSink
    from atlas_tracking.viz.html_report import run_page

    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run_id = client.create_run(client.create_experiment("intervene")).info.run_id
    delivery = Delivery(JsonlSink(tmp_path / "gates.jsonl"), [MlflowSink(client=client, run_id=run_id, figures=False)])
    policy, alerts, records = GatePolicy(), AlertEngine(), []
    for row in [(0, .083, 42, 3.00, 140, None), (500, -.027, 285, 2.32, 190, 4.73), (1000, -.020, 285, 2.32, 190, 4.53),
                (1500, -.042, 300, 2.25, 194, 4.48), (2000, -.063, 300, 2.25, 205, 4.48)]:
        summary = GateSummary(*row)
        record = {**summary.to_dict(), **policy.read(summary).to_dict(), "layers": []}
        record["alerts"] = [e.to_dict() for e in alerts.evaluate(record, record)]
        delivery.gate(record, gate_metrics(record), record["step"], record["alerts"])
        records.append(record)
    last = records[-1]
    assert (last["status"], last["stage"], [a["level"] for a in last["alerts"]]) == ("YELLOW", "intervene", ["ERROR"])
    delivery.alert({"title": "atlas: a rule", "text": "t", "level": "WARN", "key": "rule:r", "step": 2000,
                    "wait_duration_s": 1.0})
    delivery.wait(60)
    tags = client.get_run(run_id).data.tags
    assert (tags["atlas.verdict"], tags["atlas.verdict.source"], tags["atlas.stage"]) == (
        "RED", "stage intervene", "intervene")
    codes = {key: client.get_metric_history(run_id, key)[-1].value for key in ("atlas/verdict_code", "atlas/status_code")}
    assert codes == {"atlas/verdict_code": 3.0, "atlas/status_code": 2.0}
    assert (tags["atlas.alert.level"], tags["atlas.alert.max_level"], tags["atlas.alert.max_step"]) == (
        "WARN", "ERROR", "2000")
    page, _ = run_page(records, "t")
    assert '">RED</span> raised by <b>stage intervene</b>' in page.split("<h2>")[0]
