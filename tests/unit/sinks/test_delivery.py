"""Delivery bookkeeping: a tracker run's ledger (delivered.jsonl), its backlog while down, and the catch-up
from the local record after a restart. The sink here is a stand-in tracker (named as such) that can be
switched off; the W&B and MLflow versions run in test_history_trackers.py and test_crash_safety.py."""

from __future__ import annotations

from atlas_tracking.artifacts.history import read_history, read_lines
from atlas_tracking.artifacts.record import gate_metrics
from atlas_tracking.sinks.delivery import Delivery
from atlas_tracking.sinks.jsonl import JsonlSink


class StandInTracker:
    """A stand-in tracker: it keeps what it receives and fails while ``up`` is False."""

    name = "tracker"

    def __init__(self, run_key: str):
        self.run_key, self.up, self.got = run_key, True, []

    def log_gate(self, record, metrics, step):
        if not self.up:
            raise ConnectionError("down")
        self.got.append(("gate", record["step"], step))

    def alert(self, event):
        if not self.up:
            raise ConnectionError("down")
        self.got.append(("alert", event["step"]))

    def finish(self):
        return None


def _record(step, alerts=()):
    return {"step": step, "branch": "b", "c2": 0.1, "log_step": step - 1,
            "alerts": [{"title": f"a{step}", "step": step, "level": "INFO"} for _ in alerts]}


def _deliver(delivery, record):
    """One gate, then the wait for the sink's background queue (as at the end of training)."""
    delivery.gate(record, gate_metrics(record), record["log_step"], record["alerts"])
    delivery.wait(timeout_s=10.0)


def test_ledger_is_written_only_once_a_tracker_run_holds_the_gate_and_its_alerts(tmp_path):
    tracker, warnings = StandInTracker("run-1"), []
    delivery = Delivery(JsonlSink(tmp_path / "gates.jsonl"), [tracker], warn=warnings.append)
    _deliver(delivery, _record(10, alerts=[1]))
    assert tracker.got == [("gate", 10, 9), ("alert", 10)]
    tracker.up = False
    _deliver(delivery, _record(20, alerts=[1]))
    ledger = read_lines(tmp_path / "delivered.jsonl")
    assert [(d["step"], d["run"]) for d in ledger] == [(10, "run-1")]
    assert delivery.backlog_size("tracker") == 2 and "did not receive gate step 19" in warnings[0]
    tracker.up = True
    _deliver(delivery, _record(30))
    assert tracker.got[2:] == [("gate", 20, 19), ("alert", 20), ("gate", 30, 29)]
    assert [d["step"] for d in read_lines(tmp_path / "delivered.jsonl")] == [10, 20, 30]
    assert [r["step"] for r in read_history(tmp_path)] == [10, 20, 30]


def test_a_full_backlog_drops_whole_gates_and_the_catch_up_sends_them_from_the_record(tmp_path):
    tracker, warnings = StandInTracker("run-1"), []
    delivery = Delivery(JsonlSink(tmp_path / "gates.jsonl"), [tracker], warn=warnings.append, backlog_limit=2)
    tracker.up = False
    for step in (10, 20, 30):
        _deliver(delivery, _record(step))
    assert delivery.backlog_size("tracker") == 2 and any("backlog is full" in w for w in warnings)
    tracker.up = True
    _deliver(delivery, _record(40))
    assert [g[1] for g in tracker.got] == [20, 30, 40]
    history = read_history(tmp_path)
    assert delivery.catch_up(history, gate_metrics, lambda r: r["log_step"]) == 1
    delivery.wait(timeout_s=10.0)
    assert [g[1] for g in tracker.got] == [20, 30, 40, 10]
    assert delivery.catch_up(history, gate_metrics, lambda r: r["log_step"]) == 0


def test_a_new_tracker_run_catches_up_with_the_whole_history(tmp_path):
    local = JsonlSink(tmp_path / "gates.jsonl")
    first = Delivery(local, [StandInTracker("run-1")])
    for step in (10, 20):
        _deliver(first, _record(step, alerts=[1]))
    fresh = StandInTracker("run-2")
    second = Delivery(local, [fresh])
    assert second.catch_up(read_history(tmp_path), gate_metrics, lambda r: r["log_step"]) == 2
    second.wait(timeout_s=10.0)
    assert fresh.got == [("gate", 10, 9), ("alert", 10), ("gate", 20, 19), ("alert", 20)]
    again = Delivery(local, [StandInTracker("run-1")])
    assert again.catch_up(read_history(tmp_path), gate_metrics, lambda r: r["log_step"]) == 0
