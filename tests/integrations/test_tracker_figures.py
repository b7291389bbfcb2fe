"""A figure that cannot be drawn (matplotlib or pillow missing) never keeps a gate's scalars and tables from a
tracker: W&B offline files read back, a real MLflow sqlite store. One warning per figure, not per gate."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
from atlas_tracking.integrations.mlflow import MlflowSink
from atlas_tracking.integrations.wandb import WandbSink

from atlas_tracking.testing.wandb_offline import wait_for_offline_run


def _gate(step: int, c2: float) -> tuple[dict, dict]:
    layers = [{"name": f"layers.{i}.mlp", "ordinal": i, "protected": False, "c2": c2 + i, "dead_experts": 0.0}
              for i in range(2)]
    record = {"step": step, "status": "BASELINE" if step == 0 else "GREEN", "stage": "baseline", "layers": layers}
    return record, {"atlas/c2": c2, "atlas/status_code": float(step > 0)}


def _deliver(sink, steps=(0, 10)) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in steps:
            sink.log_gate(*_gate(step, 0.1 * (step + 1)), step=step)
    return [str(w.message) for w in caught if "left out" in str(w.message)]


def test_wandb_without_pillow_still_logs_scalars_and_tables(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="atlas-test", dir=str(tmp_path), mode="offline")
    monkeypatch.setitem(sys.modules, "PIL", None)  # pillow not installed: the heatmap cannot be drawn
    said = _deliver(WandbSink(run=run))
    monkeypatch.delitem(sys.modules, "PIL")
    run_dir = Path(run.dir).parent
    run.finish()
    rows = [row for row in wait_for_offline_run(run_dir)["history"] if "atlas/c2" in row]
    assert [row["trainer/global_step"] for row in rows] == [0, 10]
    assert [row["atlas/c2"] for row in rows] == pytest.approx([0.1, 1.1])
    assert all(row["atlas/layers"]["_type"] == "table-file" and "atlas/c2_heatmap" not in row for row in rows)
    assert len(said) == 1 and said[0].startswith("atlas: wandb left out the C2 heatmap figure (ModuleNotFoundError")


def test_mlflow_without_matplotlib_still_logs_metrics_tags_and_gates(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("atlas", artifact_location=str(tmp_path / "art"))).info.run_id
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # matplotlib not installed: no figure can be drawn
    said = _deliver(MlflowSink(client=client, run_id=run_id))
    monkeypatch.delitem(sys.modules, "matplotlib")
    history = client.get_metric_history(run_id, "atlas/c2")
    assert [(m.step, m.value) for m in history] == [(0, pytest.approx(0.1)), (10, pytest.approx(1.1))]
    assert client.get_run(run_id).data.tags["atlas.last_gate_step"] == "10"
    assert sorted(a.path for a in client.list_artifacts(run_id, "atlas/gates")) == [
        "atlas/gates/step_00000000.json", "atlas/gates/step_00000010.json"]
    assert client.list_artifacts(run_id, "atlas/figures") == []
    assert sorted(s.split(" (")[0] for s in said) == ["atlas: mlflow left out the C2 heatmap figure",
                                                      "atlas: mlflow left out the C2 per layer figure",
                                                      "atlas: mlflow left out the HTML report figure"]
