"""Trackers with real components: W&B offline files read back with wandb's records, a real MLflow server
on 127.0.0.1 with sqlite, tracker faults that never stop training, and the exact metric keys of one gate."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import lightning.pytorch as pl
import pytest
from atlas_tracking.integrations.lightning import AtlasCallback

from atlas_tracking.artifacts.record import gate_metrics
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


def _fit(tmp_path, loggers, steps=30, config=STRICT):
    train, val = tiny_data(steps)
    trainer = pl.Trainer(
        max_steps=steps, val_check_interval=10, check_val_every_n_epoch=None, logger=loggers,
        default_root_dir=str(tmp_path), callbacks=[AtlasCallback(canary=tiny_canary(), config=config)],
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
    for row, rec in zip(atlas_rows[1:], records[1:]):  # parameter drift beside the atlas drift
        assert row["atlas/param_drift/total"] == pytest.approx(rec["param_drift"]["total"]["relative_distance"])
        assert row["atlas/param_drift/experts_moved"] == rec["param_drift"]["groups"]["experts"]["moved"] > 0
    revoked = [a for a in data["alerts"] if "revoked" in a["title"]]
    assert records[1]["stage"] == "revoked" and len(revoked) == 1 and revoked[0]["level"] == "WARN"
    assert data["summary"]["atlas/stage"] == records[-1]["stage"]


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """A real ``mlflow server`` on 127.0.0.1 with a sqlite backend and a local artifact root."""

    def __init__(self, root: Path):
        self.root, self.port, self.proc = root, _free_port(), None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--default-artifact-root", str(self.root / "artifacts"), "--host", "127.0.0.1",
               "--port", str(self.port), "--workers", "1"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 90
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("mlflow server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
            self.proc = None


@pytest.fixture
def mlflow_server(tmp_path):
    server = MlflowServer(tmp_path / "mlflow")
    server.start()
    yield server
    server.stop()


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
    assert run.data.tags["atlas.status"] == records[-1]["status"] and run.data.tags["atlas.stage"] == records[-1]["stage"]
    assert run.data.tags["atlas.alert.title"].startswith("atlas:")
    gates = {a.path for a in client.list_artifacts(logger.run_id, "atlas/gates")}
    assert gates == {f"atlas/gates/step_{r['step']:08d}.json" for r in records}
    figures = {a.path for a in client.list_artifacts(logger.run_id, "atlas/figures")}
    assert "atlas/figures/c2_heatmap.png" in figures
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

    gate(1, 0.1)
    mlflow_server.stop()
    gate(2, 0.2)
    delivery.alert({"title": "atlas: run entered revoked at step 2", "text": "t", "level": "WARN", "key": "k",
                    "step": 2, "wait_duration_s": 1.0})
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
               "atlas/v2_c1_pass_layers", "atlas/v2_c2_pass_layers", "atlas/status_code", "atlas/stage_code",
               "atlas/gate_seconds", "atlas/ov_cf_terminal_jump", "atlas/ov_cf_adjacent_jump",
               "atlas/ov_cf_cliff_off_terminal"]
    baseline_keys = sorted(summary + layer_keys)
    drift_keys = sorted(baseline_keys + ["atlas/loss", "atlas/handoff_margin", "atlas/refine_margin", "atlas/kl_base",
                                         "atlas/canary_nll_delta"]
                        + [f"atlas/layer_{i:02d}/{k}" for i in (0, 1) for k in ("c2_delta", "boundary_drift")]
                        + [f"atlas/param_drift/{g}{m}" for g in ("router", "experts", "attention", "norms", "embeddings",
                                                                 "total") for m in ("", "_moved")])
    assert mock.calls[0] == ("log_gate", (baseline_keys, 0))
    assert mock.calls[1] == ("log_gate", (drift_keys, 9))  # Lightning logs val_loss of step 10 at step 9
    assert mock.calls[-1] == ("finish", None)
