"""RunDir: a rewind keeps every history gate's receipts file in place, by step and branch; a repair rebuilds a gate
whose line a crash cut short from its receipts."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil

import pytest

from atlas_tracking.artifacts.history import append_line, read_history, read_lines
from atlas_tracking.artifacts.run_dir import RunDir


def _gate(run: RunDir, step: int, branch: str, text: str) -> dict:
    """A gate as AtlasGate writes it: the receipts file first, then the line holding its sha256."""
    run.receipts.mkdir(parents=True, exist_ok=True)
    run.receipts_file(step).write_text(text)
    rec = {"step": step, "branch": branch, "receipts_sha256": hashlib.sha256(text.encode()).hexdigest()}
    append_line(run.gates, rec)
    return rec


def test_a_gate_rerun_on_a_new_branch_with_identical_receipts_keeps_its_file(tmp_path):
    run = RunDir(tmp_path)
    for step in (0, 10, 20):
        _gate(run, step, "a", f"receipts {step}")
    # resume on branch b from the checkpoint at step 10: gate 20 of branch a is abandoned
    run.rewind(10, lineage=[[0, "a"], [10, "a"]], branch="a")
    assert not run.receipts_file(20).exists()
    # branch b re-runs gate 20: byte-identical receipts
    again = _gate(run, 20, "b", "receipts 20")
    # resume from branch b's checkpoint at step 20: (20, b) stays, (20, a) stays abandoned
    run.rewind(20, lineage=[[0, "a"], [10, "a"], [20, "b"]], branch="b")
    assert [(r["step"], r["branch"]) for r in read_history(run.path)] == [(0, "a"), (10, "a"), (20, "b")]
    assert [(r["step"], r["branch"]) for r in read_lines(run.abandoned)] == [(20, "a")]
    path = run.receipts_file(20)
    assert path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == again["receipts_sha256"]
    for rec in read_history(run.path):
        assert hashlib.sha256(run.receipts_file(rec["step"]).read_bytes()).hexdigest() == rec["receipts_sha256"]


def test_a_history_gate_takes_its_receipts_back_from_under_any_parked_name(tmp_path):
    run = RunDir(tmp_path)
    rec = _gate(run, 0, "a", "receipts 0")
    parked = run.receipts / "abandoned"
    parked.mkdir()
    run.receipts_file(0).rename(parked / "step_00000000.unacknowledged.0123456789ab.json")
    run.rewind(0, lineage=[[0, "a"]], branch="a")
    assert hashlib.sha256(run.receipts_file(0).read_bytes()).hexdigest() == rec["receipts_sha256"]
    assert list(parked.iterdir()) == []


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A real run's record: three gates of a tiny MoE, receipts kept."""
    from atlas_tracking.gate import AtlasGate
    from atlas_tracking.testing.tiny import POST_TRAINING, tiny_canary, tiny_module

    out = tmp_path_factory.mktemp("recorded") / "atlas"
    gate = AtlasGate(tiny_module().model, tiny_canary(), POST_TRAINING, out_dir=out)
    for step, loss in [(0, 5.0), (10, 4.9), (20, 4.8)]:
        gate.run(step, loss=loss)
    gate.finish()
    return out


def _cut_last_line(run: RunDir) -> dict:
    """What a crash during the last gate's append leaves: half of its line, no newline."""
    lines = run.gates.read_text().splitlines()
    run.gates.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    return json.loads(lines[-1])


def test_a_gate_whose_line_was_cut_is_rebuilt_from_its_receipts(recorded, tmp_path, caplog):
    shutil.copytree(recorded, tmp_path / "atlas")
    run = RunDir(tmp_path / "atlas")
    whole = _cut_last_line(run)
    with caplog.at_level(logging.WARNING, logger="atlas_tracking"):
        counts = run.repair()
    assert counts["torn_lines_cut"] == 1 and counts["cut_gates_rebuilt"] == 1 and counts["cut_gates_lost"] == 0
    assert any("was rebuilt from" in r.getMessage() and "step 20" in r.getMessage() for r in caplog.records)
    history = read_history(run.path)
    assert [(r["step"], r["branch"]) for r in history] == [(0, whole["branch"]), (10, whole["branch"]),
                                                          (20, whole["branch"])]
    rebuilt = history[-1]
    assert rebuilt["rebuilt"].startswith("the line was cut by a crash")
    for name in ("run_id", "loss", "c2", "dead_experts", "mean_cv", "canary_nll", "c2_delta", "receipts_sha256",
                 "baseline_path", "canary_fingerprint"):
        assert rebuilt[name] == whole[name], name
    assert rebuilt["layers"] == whole["layers"]
    assert run.gates.read_bytes().endswith(b"\n")


def test_a_cut_gate_without_whole_receipts_is_lost_and_said_so(recorded, tmp_path, caplog):
    shutil.copytree(recorded, tmp_path / "atlas")
    run = RunDir(tmp_path / "atlas")
    whole = _cut_last_line(run)
    run.receipts_file(20).write_text('{"kind": "atlas-receipts", "schema_ver')  # not whole
    for step in (10, 20):  # a tracker had received both gates
        append_line(run.delivered, {"step": step, "branch": whole["branch"], "sink": "mlflow", "run": "r"})
    with caplog.at_level(logging.WARNING, logger="atlas_tracking"):
        counts = run.repair()
    assert counts["cut_gates_rebuilt"] == 0 and counts["cut_gates_lost"] == 1
    assert [r["step"] for r in read_history(run.path)] == [0, 10]
    assert any("step 20" in r.getMessage() and "that gate is lost" in r.getMessage() for r in caplog.records)
    assert [d["step"] for d in read_lines(run.delivered)] == [10]  # the ledger names only gates the record holds
