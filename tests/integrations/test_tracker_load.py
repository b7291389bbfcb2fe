"""The training-batch load between gates reaches the trackers through the gates' background delivery, with real
parts: an offline W&B run read back with wandb's records, a real MLflow server on 127.0.0.1 (sqlite), a Lightning
CSVLogger; a tracker that is down keeps a bounded queue of intervals that never pushes a gate out; and a tiny
Lightning fit with W&B and MLflow loggers attached holds each interval at Lightning's logger step.

The keys are checked against the generated tracker-key table (docs/trackers.md) and the values against a numpy
reference written here from the definitions (docs/telemetry.md#what-the-numbers-mean)."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from atlas_tracking.integrations.lightning import AtlasCallback, tracker_sinks

from atlas_tracking.artifacts.load_summary import load_metrics
from atlas_tracking.gate import AtlasGate
from atlas_tracking.schema.load import SUMMARY_KEYS, ranked_keys
from atlas_tracking.sinks.delivery import Delivery
from atlas_tracking.sinks.jsonl import JsonlSink
from atlas_tracking.testing.lightning_lm import VOCAB_SIZE
from atlas_tracking.testing.mlflow_server import MlflowServer
from atlas_tracking.testing.tiny import QUIET, tiny_canary, tiny_data, tiny_module
from atlas_tracking.testing.wandb_offline import wait_for_offline_run
from atlas_tracking.viz.reference import tracker_keys

TOP = 3
PICTURE = {"atlas/train/experts", "atlas/train/expert_load"}
OPTIONAL = {SUMMARY_KEYS["overload_factor"], SUMMARY_KEYS["dropped_fraction"]}
"""Summary keys of expert-parallel layers and layers with a capacity limit only (the lines here have neither)."""
SCALARS = set(SUMMARY_KEYS.values()) - OPTIONAL | set(ranked_keys(TOP))
TELEMETRY_EVERY_5 = {**QUIET, "telemetry": {**QUIET["telemetry"], "every_n_steps": 5}}
"""Intervals of 5 steps; no early gate (QUIET's), so the fit's gates stay at the start and its validation."""


@pytest.fixture(autouse=True)
def _offline_env(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))


def load_line(step: int, layers: int, experts: int, seed: int, every: int = 5) -> dict:
    """A ``load.jsonl`` line of the counter's shape: per layer, a skewed integer load of 2 routes per token over
    ``experts`` experts, the last of them dead."""
    rng = np.random.default_rng(seed)
    tokens = 8 * 32 * every
    rows = []
    for i in range(layers):
        p = rng.dirichlet(np.full(experts, 0.7))
        p[-1] = 0.0
        rows.append({"layer": i, "name": f"model.layers.{i}.mlp", "load": rng.multinomial(2 * tokens, p / p.sum()).tolist(),
                     "dropped": None, "tokens": tokens, "calls": every, "processes": 1})
    return {"schema_version": 2, "step": step, "first_step": step - every + 1, "tokens": tokens, "layers": rows,
            "run_id": "r", "branch": "b", "phase": "pretraining", "reference_step": None, "breach": [], "alerts": [],
            "alarm": False, "early_gate": False}


def reference(line: dict, top: int = TOP) -> dict[str, float]:
    """The interval's tracker scalars from their definitions, in plain numpy: per layer the population CV of the
    loads, max over mean, dead fraction and entropy over ln E; the worst layer's ranked experts."""
    loads = [np.asarray(row["load"], dtype=np.float64) for row in line["layers"]]
    cv = [load.std() / load.mean() for load in loads]
    worst = int(np.argmax(cv))  # the first layer of the largest CV

    def entropy(load):
        f = load[load > 0] / load.sum()
        return float(-(f * np.log(f)).sum() / np.log(load.size))

    out = {"atlas/train/tokens": line["tokens"], "atlas/train/load_cv_max": cv[worst],
           "atlas/train/worst_layer": line["layers"][worst]["layer"],
           "atlas/train/max_over_mean": max(load.max() / load.mean() for load in loads),
           "atlas/train/dead_fraction_max": max(float((load == 0).mean()) for load in loads),
           "atlas/train/entropy_min": min(entropy(load) for load in loads),
           "atlas/train/breach_layers": len(line["breach"]), "atlas/train/alarm": int(line["alarm"])}
    shares = loads[worst] / loads[worst].sum()
    for end, order in (("top", sorted(range(shares.size), key=lambda e: (-shares[e], e))),
                       ("bottom", sorted(range(shares.size), key=lambda e: (shares[e], e)))):
        for i, e in enumerate(order[:top], start=1):
            out[f"atlas/train/{end}{i}_expert"], out[f"atlas/train/{end}{i}_share"] = e, shares[e]
    return out


def documented() -> list[re.Pattern]:
    """The generated tracker-key table's keys as patterns (``<i>``: a rank)."""
    keys = re.findall(r"^\| `(atlas/[^`]+)` \|", tracker_keys(), re.M)
    return [re.compile("^" + re.escape(k).replace("NN", r"\d\d").replace("<group>", r"\w+").replace("<i>", r"\d+")
                       + "$") for k in keys]


def assert_values(got: dict, line: dict) -> None:
    for key, value in reference(line).items():
        assert got[key] == pytest.approx(value, abs=6e-5 if key.endswith("_share") else 1e-9), key


# --- W&B -----------------------------------------------------------------------------------------------------


def test_wandb_offline_run_holds_bounded_keys_at_their_steps_whatever_the_layer_count(tmp_path):
    import wandb
    from atlas_tracking.integrations.wandb import WandbSink

    run = wandb.init(project="atlas-test", dir=str(tmp_path), mode="offline")
    told: list[str] = []
    delivery = Delivery(None, [WandbSink(run=run)], warn=told.append)
    # 2 layers x 8 experts, then 12 layers x 64 experts; the picture with the first interval of each shape
    intervals = [(load_line(5, 2, 8, 0), True), (load_line(10, 2, 8, 1), False),
                 (load_line(15, 12, 64, 2), True), (load_line(20, 12, 64, 3), False)]
    for line, picture in intervals:
        delivery.load(line, load_metrics(line, TOP), line["step"] - 1, picture)  # Lightning's logger step
    assert delivery.wait(timeout_s=60.0) == {"wandb": 0} and told == []
    run_dir = Path(run.dir).parent
    run.finish()
    data = wait_for_offline_run(run_dir)
    assert data["complete"]
    rows = [row for row in data["history"] if any(k.startswith("atlas/") for k in row)]
    assert [row["trainer/global_step"] for row in rows] == [4, 9, 14, 19]
    patterns = documented()
    for row, (line, picture) in zip(rows, intervals):
        keys = {k for k in row if k.startswith("atlas/")}
        assert all(any(p.match(k) for p in patterns) for k in keys), keys  # every key is in the table
        # the bounded scalars and nothing per layer or per expert beyond the ranked ones
        assert keys == SCALARS | (PICTURE if picture else set()), keys ^ SCALARS
        assert_values(row, line)
        if picture:
            assert row["atlas/train/expert_load"]["_type"] == "image-file"
            assert row["atlas/train/experts"]["_type"] == "table-file"
            table = json.loads((run_dir / "files" / row["atlas/train/experts"]["path"]).read_text())
            assert table["columns"] == ["step", "layer", "name", "expert", "routes", "share", "dead"]
            expected = [[line["step"], r["layer"], r["name"], e, n, n / sum(r["load"]), n == 0]
                        for r in line["layers"] for e, n in enumerate(r["load"])]
            assert [x[:5] + x[6:] for x in table["data"]] == [x[:5] + x[6:] for x in expected]
            assert [x[5] for x in table["data"]] == pytest.approx([x[5] for x in expected])
    # the key count is independent of the model's depth and width: 2 x 8 and 12 x 64 give the same keys
    train_keys = [{k for k in row if k.startswith("atlas/train/")} for row in rows]
    assert train_keys[0] == train_keys[2] and train_keys[1] == train_keys[3]
    assert len(set().union(*train_keys)) == len(SUMMARY_KEYS) - len(OPTIONAL) + 4 * TOP + len(PICTURE) == 22


# --- MLflow --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    server.start()
    yield server
    server.stop()


def test_mlflow_server_holds_metrics_at_the_given_step_and_the_line_and_figure_of_picture_intervals(
        tmp_path, mlflow_server):
    from atlas_tracking.integrations.mlflow import MlflowSink
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run_id = client.create_run(client.create_experiment("load")).info.run_id
    told: list[str] = []
    delivery = Delivery(None, [MlflowSink(client=client, run_id=run_id)], warn=told.append)
    intervals = [(load_line(5, 2, 8, 0), True), (load_line(10, 3, 16, 1), False), (load_line(15, 3, 16, 2), True)]
    for line, picture in intervals:
        delivery.load(line, load_metrics(line, TOP), line["step"] - 1, picture)
    assert delivery.wait(timeout_s=60.0) == {"mlflow": 0} and told == []
    assert set(client.get_run(run_id).data.metrics) == SCALARS
    for key in SCALARS:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert [step for step, _ in history] == [4, 9, 14], key
        for (_, value), (line, _) in zip(history, intervals):
            assert value == pytest.approx(reference(line)[key], abs=6e-5 if key.endswith("_share") else 1e-9), key
    pictured = [line["step"] for line, picture in intervals if picture]
    lines = {a.path for a in client.list_artifacts(run_id, "atlas/load")}
    assert lines == {f"atlas/load/step_{s:08d}.json" for s in pictured}
    stored = json.loads(Path(client.download_artifacts(run_id, "atlas/load/step_00000015.json",
                                                       str(tmp_path / "dl"))).read_text())
    assert stored == intervals[2][0]
    figures = {a.path for a in client.list_artifacts(run_id, "atlas/figures")}
    assert figures == {f"atlas/figures/train_expert_load_{s:08d}.png" for s in pictured}
    png = client.download_artifacts(run_id, "atlas/figures/train_expert_load_00000005.png", str(tmp_path / "dl2"))
    assert Path(png).read_bytes()[:4] == b"\x89PNG"


# --- any Lightning logger ------------------------------------------------------------------------------------


def test_a_lightning_logger_without_a_sink_of_its_own_gets_the_scalars(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path), name="csv")
    (sink,) = tracker_sinks([logger])
    delivery = Delivery(None, [sink])
    intervals = [(load_line(5, 2, 8, 0), True), (load_line(10, 2, 8, 1), False)]
    for line, picture in intervals:
        delivery.load(line, load_metrics(line, TOP), line["step"] - 1, picture)
    assert delivery.wait(timeout_s=30.0) == {sink.name: 0}
    logger.save()
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(row["step"]) for row in rows] == [4, 9]
    assert set(rows[0]) == SCALARS | {"step"}  # scalars only: no table or picture
    for row, (line, _) in zip(rows, intervals):
        assert_values({k: float(v) for k, v in row.items()}, line)


# --- a tracker that is down ----------------------------------------------------------------------------------


class DownTracker:
    """A test double (named as such) for a tracker whose server is down, then back: every call raises
    ConnectionError while ``down``; what arrives once it is back is recorded in order."""

    name = "down"

    def __init__(self):
        self.down, self.got = True, []

    def _take(self, what: tuple) -> None:
        if self.down:
            raise ConnectionError("tracker server down")
        self.got.append(what)

    def log_gate(self, record, metrics, step):
        self._take(("gate", record["step"]))

    def log_load(self, line, metrics, step, picture):
        self._take(("load", line["step"]))

    def alert(self, event):
        self._take(("alert", event["title"]))

    def finish(self):
        pass


def test_intervals_queue_bounded_for_a_tracker_that_is_down_and_never_push_a_gate_out(tmp_path):
    told: list[str] = []
    tracker = DownTracker()
    delivery = Delivery(JsonlSink(tmp_path / "gates.jsonl"), [tracker], warn=told.append, backlog_limit=3)
    delivery.gate({"step": 0, "status": "BASELINE"}, {"atlas/c2": 0.1}, step=0)
    for step in (5, 10, 15, 20, 25):
        delivery.load(load_line(step, 2, 8, step), {"atlas/train/load_cv_max": 1.0}, step, False)
    delivery.alert({"title": "atlas: training-batch routing alarm", "text": "t", "level": "WARN", "step": 25})
    for step in (30, 35):
        delivery.load(load_line(step, 2, 8, step), {"atlas/train/load_cv_max": 1.0}, step, False)
    delivery.wait(timeout_s=10.0)
    # the gate and the alert wait whole (intervals do not count towards the limit of 3), with the 3 newest intervals
    assert delivery.backlog_size("down") == 2 and delivery.backlog() == {"down": [(0, None)]}
    assert tracker.got == []
    failed = [m for m in told if " did not receive " in m]  # said once, by the sink's thread
    assert len(failed) == 1 and failed[0].startswith("atlas: down did not receive gate step 0 (ConnectionError: ")
    dropped = [m for m in told if "training-batch load interval(s) or rollout step(s) were dropped" in m]
    assert len(dropped) == 4 and not any("gate(s) or alert(s)" in m for m in told)  # 5, 10, 15, 20: one at a time
    tracker.down = False
    delivery.gate({"step": 40, "status": "GREEN"}, {"atlas/c2": 0.2}, step=40)  # the next gate retries the queue
    delivery.wait(timeout_s=10.0)
    assert tracker.got == [("gate", 0), ("load", 25), ("alert", "atlas: training-batch routing alarm"), ("load", 30),
                           ("load", 35), ("gate", 40)]
    assert delivery.backlog_size("down") == 0 and "reachable again" in told[-1]


class LineOnDisk:
    """A sink (a test double, named as such) that reads ``load.jsonl`` when an interval reaches it."""

    name = "line-on-disk"

    def __init__(self, path: Path):
        self.path, self.seen = path, []

    def log_gate(self, record, metrics, step):
        pass

    def log_load(self, line, metrics, step, picture):
        on_disk = [json.loads(x)["step"] for x in self.path.read_text().splitlines()] if self.path.exists() else []
        self.seen.append((line["step"], on_disk))

    def alert(self, event):
        pass

    def finish(self):
        pass


def test_an_interval_is_in_load_jsonl_before_any_tracker_hears_of_it(tmp_path):
    out = tmp_path / "atlas"
    sink = LineOnDisk(out / "load.jsonl")
    module = tiny_module()
    config = {**QUIET, "telemetry": {**QUIET["telemetry"], "every_n_steps": 2}}
    gate = AtlasGate(module.model, tiny_canary(), config, out_dir=out, sinks=[sink])
    queued = []  # what load.jsonl holds at the moment the interval is handed to the delivery (on this thread)
    handed = gate.delivery.load

    def load(line, metrics, step, picture):
        queued.append((line["step"], [json.loads(x)["step"] for x in (out / "load.jsonl").read_text().splitlines()]))
        handed(line, metrics, step, picture)

    gate.delivery.load = load
    module.model.train()
    for step in (1, 2, 3, 4):
        module.model(torch.randint(0, VOCAB_SIZE, (4, 32)))  # a training forward (gradients on; no update needed)
        gate.step(step)
    gate.delivery.wait(timeout_s=10.0)
    assert queued == [(2, [2]), (4, [2, 4])]
    assert [step for step, _ in sink.seen] == [2, 4] and all(step in disk for step, disk in sink.seen)
    line = json.loads((out / "load.jsonl").read_text().splitlines()[0])
    assert [sum(row["load"]) for row in line["layers"]] == [2 * 2 * 4 * 32] * 2  # top-2 of 2 steps of 4 x 32 tokens


# --- end to end ----------------------------------------------------------------------------------------------


def test_a_lightning_fit_sends_each_interval_to_wandb_and_mlflow_at_the_logger_step(tmp_path):
    import wandb
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger
    from mlflow.tracking import MlflowClient

    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    wandb_logger = WandbLogger(project="atlas-test", save_dir=str(tmp_path), offline=True)
    mlflow_logger = MLFlowLogger(experiment_name="atlas-load", tracking_uri=db)
    train, val = tiny_data(20)
    trainer = pl.Trainer(
        max_steps=20, val_check_interval=20, check_val_every_n_epoch=None, logger=[wandb_logger, mlflow_logger],
        default_root_dir=str(tmp_path), enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[AtlasCallback(canary=tiny_canary(), config=TELEMETRY_EVERY_5)],
        accelerator="cpu", devices=1, enable_checkpointing=False, log_every_n_steps=5,
    )
    trainer.fit(tiny_module(), train, val)
    lines = [json.loads(x) for x in (tmp_path / "atlas" / "load.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [5, 10, 15, 20]
    steps = [line["step"] - 1 for line in lines]  # Lightning's logger step
    values = [reference(line)["atlas/train/load_cv_max"] for line in lines]
    run_dir = Path(wandb_logger.experiment.dir).parent
    wandb.finish()
    data = wait_for_offline_run(run_dir)
    rows = [row for row in data["history"] if "atlas/train/load_cv_max" in row]
    assert [row["trainer/global_step"] for row in rows] == steps == [4, 9, 14, 19]
    assert [row["atlas/train/load_cv_max"] for row in rows] == pytest.approx(values)
    train_loss = {row["trainer/global_step"] for row in data["history"] if "train_loss" in row}
    assert set(steps) <= train_loss  # the step Lightning logs its own metrics at
    assert ["atlas/train/expert_load" in row for row in rows] == [True, False, False, False]  # picture_every 10
    history = MlflowClient(tracking_uri=db).get_metric_history(mlflow_logger.run_id, "atlas/train/load_cv_max")
    history = sorted((m.step, m.value) for m in history)
    assert [step for step, _ in history] == steps and [value for _, value in history] == pytest.approx(values)
