"""Retention of a pretraining run's baselines and receipts artifacts, resumes onto a pruned reference, a crash
between the save and the prune, and ``atlas-tracking du`` / ``pin`` on a real run directory."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from atlas_tracking.artifacts.history import read_history, read_lines
from atlas_tracking.cli import main
from atlas_tracking.gate import AtlasGate
from atlas_tracking.testing.tiny import QUIET, tiny_canary, tiny_module

PRETRAINING = {**QUIET, "policy": {"phase": "pretraining"}, "gate": {"pin_baselines": [10], "keep_receipts": 3}}


def _gate(out: Path) -> AtlasGate:
    return AtlasGate(tiny_module().model, tiny_canary(), PRETRAINING, out_dir=out)


def _steps(folder: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1].split(".")[0]) for p in folder.iterdir() if p.name.startswith("step_"))


def _disk_bytes(path: Path) -> int:
    return sum(os.lstat(Path(root) / f).st_size for root, _, files in os.walk(path) for f in files
               if not (Path(root) / f).is_symlink())


def test_pretraining_keeps_the_current_previous_and_pinned_baselines(tmp_path, caplog):
    out = tmp_path / "atlas"
    gate = _gate(out)
    with caplog.at_level(logging.INFO, logger="atlas_tracking"):
        records = [gate.run(step, loss=4.0) for step in range(0, 60, 10)]
    assert _steps(out / "baselines") == [10, 40, 50]                      # pinned, previous, current
    assert os.readlink(out / "baseline").endswith(records[-1]["baseline_path"].rpartition("/")[2])
    pruned = {r["step"]: r.get("pruned_baselines") for r in read_history(out)}
    branch = gate.branch
    assert pruned == {0: None, 10: None, 20: [f"baselines/step_00000000.{branch}"], 30: None,
                      40: [f"baselines/step_00000020.{branch}"], 50: [f"baselines/step_00000030.{branch}"]}
    lines = [m for m in caplog.messages if m.startswith("atlas: retention pruned")]
    assert len(lines) == 4 and f"step_00000020.{branch}, receipts/step_00000010.json" in lines[2]  # one per prune
    assert int(lines[2].split("freeing ")[1].split()[0]) == read_history(out)[4]["pruned_bytes"] > 0
    # receipts: the last 3 gates' artifacts stay, gates.jsonl keeps every gate and its sha256
    assert _steps(out / "receipts") == [30, 40, 50]
    assert len(read_lines(out / "gates.jsonl")) == 6 and all(r["receipts_sha256"] for r in read_history(out))
    assert read_history(out)[-1]["retention"] == {"keep_baselines": 2, "keep_receipts": 3, "pinned": [10]}


def test_verify_names_a_receipts_artifact_retention_removed(tmp_path, capsys):
    out = tmp_path / "atlas"
    gate = _gate(out)
    for step in range(0, 50, 10):
        gate.run(step, loss=4.0)
    assert main(["verify", str(out / "receipts" / "step_00000000.json")]) == 2
    assert "pruned by retention (gate.keep_receipts) at the gate of step 30" in capsys.readouterr().err
    assert main(["report", str(out / "receipts" / "step_00000010.json"), "--out", str(tmp_path / "r.html")]) == 2
    assert "pruned by retention (gate.keep_receipts) at the gate of step 40" in capsys.readouterr().err


def test_a_resume_onto_a_pruned_reference_is_an_honest_baseline(tmp_path, caplog):
    out = tmp_path / "atlas"
    gate = _gate(out)
    for step in range(0, 30, 10):
        gate.run(step, loss=4.0)
    state = gate.state_dict()                                              # a checkpoint at step 20
    for step in range(30, 60, 10):
        gate.run(step, loss=4.0)
    assert not Path(state["baseline_path"]).exists()                       # pruned at the gate of step 40
    resumed = _gate(out)
    resumed.resume(20, state)
    with caplog.at_level(logging.WARNING, logger="atlas_tracking"):
        record = resumed.run(30, loss=4.0)
    assert record["status"] == "BASELINE" and record["resume"]
    assert record["reference_pruned"] == (f"{state['baseline_path']}: pruned by retention (gate.keep_baselines) "
                                          "at the gate of step 40")
    assert any("was pruned by retention" in m for m in caplog.messages)
    assert read_history(out)[-1]["reference_pruned"] == record["reference_pruned"]


def test_post_training_keeps_the_base_across_resumes(tmp_path):
    out = tmp_path / "atlas"
    model, canary, config = tiny_module().model, tiny_canary(), {**QUIET, "policy": {"phase": "post_training"}}
    gate = AtlasGate(model, canary, config, out_dir=out)
    gate.run(0, loss=4.0)                                                  # the base (the handoff baseline)
    for step in (10, 20, 30):                                              # a restart before each gate
        state = gate.state_dict()
        gate = AtlasGate(model, canary, config, out_dir=out)
        gate.resume(step - 5, state)
        assert gate.run(step, loss=4.0)["status"] == "BASELINE"
    assert _steps(out / "baselines") == [0, 20, 30]                        # the base, the previous, the current
    assert read_history(out)[-1]["pruned_baselines"] == [f"baselines/step_00000010.{read_history(out)[1]['branch']}"]
    assert read_history(out)[-1]["base_step"] == 0


def test_a_declared_handoff_reference_in_the_run_directory_stays(tmp_path):
    out = tmp_path / "atlas"
    model, canary, config = tiny_module().model, tiny_canary(), {**QUIET, "policy": {"phase": "pretraining"}}
    gate = AtlasGate(model, canary, config, out_dir=out)
    gate.run(0, loss=4.0)
    gate.run(10, loss=4.0)
    healthy = next((out / "baselines").glob("step_00000000.*"))
    declared = {**config, "lifecycle": {"handoff_reference": str(healthy)}}
    resumed = AtlasGate(model, canary, declared, out_dir=out)
    resumed.resume(10, gate.state_dict())
    for step in (20, 30, 40):
        resumed.run(step, loss=4.0)
    assert _steps(out / "baselines") == [0, 30, 40]                        # the reference, previous, current


class Killed(BaseException):
    """The process dies here (nothing catches it)."""


def test_a_crash_between_save_and_prune_leaves_an_extra_folder_and_the_next_gate_prunes_it(tmp_path, monkeypatch):
    out = tmp_path / "atlas"
    gate = _gate(out)
    for step in (0, 10):
        gate.run(step, loss=4.0)

    def killed(run, relative):
        raise Killed

    monkeypatch.setattr("atlas_tracking.gate.remove", killed)
    with pytest.raises(Killed):
        gate.run(20, loss=4.0)
    monkeypatch.undo()
    history = read_history(out)                                            # readable, and it names the victim
    assert [r["step"] for r in history] == [0, 10, 20]
    assert history[-1]["pruned_baselines"] == [f"baselines/step_00000000.{gate.branch}"]
    assert _steps(out / "baselines") == [0, 10, 20]                        # an extra folder, no missing reference
    assert json.loads((out / "baseline" / "manifest.json").read_text())["step"] == 20
    resumed = _gate(out)
    resumed.resume(20, gate.state_dict())
    record = resumed.run(30, loss=4.0)
    assert f"baselines/step_00000000.{gate.branch}" in record["pruned_baselines"]
    assert _steps(out / "baselines") == [10, 20, 30]
    assert not [p for p in (out / "baselines").iterdir() if p.name.startswith(".")]


def test_a_failed_prune_is_a_warning_and_training_goes_on(tmp_path, monkeypatch, caplog):
    out = tmp_path / "atlas"
    gate = _gate(out)
    for step in (0, 10):
        gate.run(step, loss=4.0)

    def read_only(run, relative):
        raise PermissionError("read-only file system")

    monkeypatch.setattr("atlas_tracking.gate.remove", read_only)
    with caplog.at_level(logging.WARNING, logger="atlas_tracking"):
        assert gate.run(20, loss=4.0)["status"] == "GREEN"
    assert any("retention could not remove" in m and "the next gate tries again" in m for m in caplog.messages)
    monkeypatch.undo()
    gate.run(30, loss=4.0)
    assert _steps(out / "baselines") == [10, 20, 30]


def test_du_figures_are_the_sizes_on_disk_and_pin_keeps_a_baseline(tmp_path, capsys):
    out = tmp_path / "atlas"
    gate = _gate(out)
    for step in range(0, 40, 10):
        gate.run(step, loss=4.0)
    assert main(["pin", str(out), "20"]) == 0 and "pinned step 20" in capsys.readouterr().out
    assert main(["pin", str(out), "25"]) == 2
    for step in (40, 50):
        gate.run(step, loss=4.0)
    assert _steps(out / "baselines") == [10, 20, 40, 50]
    capsys.readouterr()
    assert main(["du", str(out), "--json"]) == 0
    usage = json.loads(capsys.readouterr().out)
    assert usage["total"] == _disk_bytes(out) == sum(usage["bytes"].values())
    assert usage["bytes"]["baselines"] == _disk_bytes(out / "baselines")
    assert usage["bytes"]["receipts"] == _disk_bytes(out / "receipts")
    assert usage["bytes"]["gates"] == (out / "gates.jsonl").stat().st_size
    assert {b["step"]: (b["bytes"], b["roles"]) for b in usage["baselines"]} == {
        s: (_disk_bytes(out / "baselines" / f"step_{s:08d}.{gate.branch}"), roles)
        for s, roles in [(10, ["pinned"]), (20, ["pinned"]), (40, []), (50, ["current"])]}
    last = out / "gates.jsonl"
    assert usage["gates"] == 6 and usage["bytes_per_gate"]["mean"] == usage["total"] / 6
    assert usage["bytes_per_gate"]["last"] == (len(last.read_bytes().splitlines()[-1]) + 1
                                               + (out / "receipts" / "step_00000050.json").stat().st_size
                                               + _disk_bytes(out / "baselines" / f"step_00000050.{gate.branch}"))
    assert usage["retention"] == {"keep_baselines": 2, "keep_receipts": 3, "pinned": [10, 20]}
    assert main(["du", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"{out}: {usage['total']} bytes, 6 gate(s)")
    assert "retention: gate.keep_baselines 2, gate.keep_receipts 3, pinned steps 10, 20" in text
