"""Tracker calls off the training thread: the record's order kept per sink, a sink that never answers held
only for the bounded wait at the end, its backlog reported (warning, ``backlog.json``, ``atlas-tracking
gates``), and nothing lost: gates it did not receive stay listed until ``delivered.jsonl`` notes them.
The sinks are stand-in trackers (named as such): one slow, one that never answers until released."""

from __future__ import annotations

import json
import threading
import time

import pytest

from atlas_tracking.artifacts.history import read_lines
from atlas_tracking.artifacts.record import gate_metrics
from atlas_tracking.cli import main
from atlas_tracking.schema.config import AtlasConfig, ConfigError
from atlas_tracking.sinks.delivery import Delivery
from atlas_tracking.sinks.jsonl import JsonlSink


class SlowStandInTracker:
    """A stand-in tracker that takes ``delay`` seconds per call and keeps what it receives, with the thread."""

    name = "slow"
    run_key = "run-slow"

    def __init__(self, delay: float):
        self.delay, self.got, self.threads = delay, [], set()

    def log_gate(self, record, metrics, step):
        time.sleep(self.delay)
        self.threads.add(threading.get_ident())
        self.got.append(("gate", record["step"]))

    def alert(self, event):
        self.got.append(("alert", event["step"]))

    def finish(self):
        self.got.append(("finish", None))


class HangingStandInTracker:
    """A stand-in tracker whose calls block until ``release`` is set (a server that never answers)."""

    name = "hanging"
    run_key = "run-hanging"

    def __init__(self):
        self.release, self.got, self.finished = threading.Event(), [], False

    def log_gate(self, record, metrics, step):
        self.release.wait()
        self.got.append(record["step"])

    def alert(self, event):
        self.release.wait()

    def finish(self):
        self.finished = True


def _record(step, alerts=0):
    return {"step": step, "branch": "b", "c2": 0.1,
            "alerts": [{"title": f"a{step}", "step": step, "level": "WARN"} for _ in range(alerts)]}


def _gate(delivery, record):
    delivery.gate(record, gate_metrics(record), record["step"], record["alerts"])


def test_calls_run_off_the_training_thread_in_the_records_order(tmp_path):
    tracker = SlowStandInTracker(delay=0.05)
    delivery = Delivery(JsonlSink(tmp_path / "gates.jsonl"), [tracker], warn=lambda message: None)
    t0 = time.monotonic()
    for step in range(0, 100, 10):
        _gate(delivery, _record(step, alerts=1 if step % 20 else 0))
    queued = time.monotonic() - t0
    assert queued < 10 * 0.05  # the training thread did not wait for the ten slow calls
    assert delivery.finish() == {"slow": []}
    gates = [step for kind, step in tracker.got if kind == "gate"]
    assert gates == list(range(0, 100, 10))
    assert tracker.got[:4] == [("gate", 0), ("gate", 10), ("alert", 10), ("gate", 20)]
    assert tracker.got[-1] == ("finish", None) and threading.get_ident() not in tracker.threads
    assert [d["step"] for d in read_lines(tmp_path / "delivered.jsonl")] == list(range(0, 100, 10))
    assert json.loads((tmp_path / "backlog.json").read_text()) == {"sinks": {}}


def test_a_sink_that_never_answers_holds_training_only_for_the_bounded_wait(tmp_path):
    hanging, slow, warnings = HangingStandInTracker(), SlowStandInTracker(delay=0.0), []
    delivery = Delivery(JsonlSink(tmp_path / "gates.jsonl"), [hanging, slow], warn=warnings.append, wait_s=0.5)
    t0 = time.monotonic()
    for step in (0, 10, 20):
        _gate(delivery, _record(step, alerts=1))
    assert time.monotonic() - t0 < 2.0  # generous: queuing three gates, not waiting for the tracker
    t1 = time.monotonic()
    backlog = delivery.finish()
    assert 0.4 < time.monotonic() - t1 < 5.0  # the bounded wait, then training goes on
    assert backlog == {"hanging": [(0, "b"), (10, "b"), (20, "b")], "slow": []}
    assert [step for kind, step in slow.got if kind == "gate"] == [0, 10, 20]  # the other sink is not held
    assert not hanging.finished and len(warnings) == 1
    assert warnings[0].startswith("atlas: 3 gate(s) did not reach hanging by the end of training")
    assert "resume the run from a checkpoint" in warnings[0]
    assert json.loads((tmp_path / "backlog.json").read_text()) == {
        "sinks": {"hanging": {"run": "run-hanging", "steps": [[0, "b"], [10, "b"], [20, "b"]]}}}


def test_a_call_already_stalled_for_the_wait_is_not_waited_for_again(tmp_path):
    hanging = HangingStandInTracker()
    delivery = Delivery(JsonlSink(tmp_path / "gates.jsonl"), [hanging], warn=lambda message: None, wait_s=0.3)
    _gate(delivery, _record(0))
    time.sleep(0.5)  # training went on longer than the wait since the call started
    t0 = time.monotonic()
    assert delivery.finish() == {"hanging": [(0, "b")]}
    assert time.monotonic() - t0 < 0.25


def test_gates_not_delivered_stay_listed_until_the_ledger_holds_them(tmp_path, capsys):
    for step in (0, 10):
        JsonlSink(tmp_path / "gates.jsonl").log_gate(_record(step), {}, step)
    hanging = HangingStandInTracker()
    delivery = Delivery(JsonlSink(tmp_path / "gates.jsonl"), [], warn=lambda message: None, wait_s=0.2)
    delivery.add(hanging)
    delivery.catch_up([_record(0), _record(10)], gate_metrics, lambda r: r["step"])
    delivery.finish()
    assert main(["gates", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "not yet delivered: hanging (run run-hanging): 2 gate(s), steps 0, 10" in text
    assert "resume the run from a checkpoint" in text
    hanging.release.set()  # the tracker answers at last: the queued gates arrive and the ledger notes them
    for _ in range(100):
        if len(read_lines(tmp_path / "delivered.jsonl")) == 2:
            break
        time.sleep(0.05)
    assert hanging.got == [0, 10]
    assert main(["gates", str(tmp_path)]) == 0
    assert "delivered: hanging (run run-hanging) holds every gate of the history" in capsys.readouterr().out


def test_the_wait_is_a_configuration_key():
    assert AtlasConfig().gate.delivery_wait_s == 10.0
    assert AtlasConfig.from_dict({"gate": {"delivery_wait_s": 0.5}}).gate.delivery_wait_s == 0.5
    with pytest.raises(ConfigError, match="delivery_wait_s"):
        AtlasConfig.from_dict({"gate": {"delivery_wait_s": -1}})
