"""A full disk, as a real cluster has one: the record's story stays true and training never stops.

The run directory sits on :class:`~atlas_tracking.testing.disk_full.Disk`, a shim that raises ``ENOSPC`` at chosen
writes (part-way through a line when asked). Through the public surface: the plain loop's ``AtlasGate`` and the
Lightning callback.
"""

from __future__ import annotations

import json
import logging
import shutil

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from atlas_tracking import Canary
from atlas_tracking.artifacts.history import read_history, read_lines
from atlas_tracking.artifacts.load_record import read_load
from atlas_tracking.decisions.replay import replay
from atlas_tracking.gate import AtlasGate
from atlas_tracking.schema.config import AtlasConfig
from atlas_tracking.testing.disk_full import Disk
from atlas_tracking.testing.tiny import QUIET, tiny_canary, tiny_data, tiny_module

CONFIG = {"receipts": {"progress": False, "n_bootstrap": 100, "anchors": 32}, "policy": {"phase": "post_training"},
          "gate": {"delivery_wait_s": 1.0}}


class Recorder:
    """A tracker that needs no disk: it keeps what it receives."""

    name = "recorder"

    def __init__(self):
        self.gates: list[int] = []
        self.alerts: list[dict] = []

    def log_gate(self, record, metrics, step):
        self.gates.append(record["step"])

    def alert(self, event):
        self.alerts.append(event)

    def finish(self):
        pass


def _model(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2))


CANARY = Canary.from_token_ids(np.arange(2000) % 64, window=32, n_windows=8, seed=0)


def _nudge(model: torch.nn.Module, scale: float, seed: int) -> None:
    """Training between gates, as far as the gate can tell: the routers move."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(scale * torch.randn(p.shape, generator=gen))


def _gate(out, sinks=None, config=CONFIG, model=None) -> AtlasGate:
    return AtlasGate(model if model is not None else _model(), CANARY, config, out_dir=out, sinks=sinks or [])


def _decisions(records):
    return [(r["step"], r["status"], r["stage"], r["action"]) for r in records]


def test_a_gate_whose_line_cannot_be_written_does_not_move_the_run(tmp_path, caplog):
    out = tmp_path / "atlas"
    disk, tracker = Disk(out), Recorder()
    gate = _gate(out, [tracker])
    live = {}
    with disk.mounted():
        for step in (0, 10, 20):
            _nudge(gate.model, 0.3, step)
            live[step] = gate.run(step, loss=4.0 - step / 100)
        before = (json.dumps(gate.policy.state_dict(), sort_keys=True), [list(k) for k in gate.lineage])
        saved = gate.state_dict()
        disk.fill()
        _nudge(gate.model, 3.0, 30)
        with caplog.at_level(logging.ERROR, logger="atlas_tracking"):
            failed = gate.run(30, loss=4.5)
        assert failed["status"] == "FAILED" and failed["step"] == 30 and failed["waiting"] >= 3
        assert "No space left on device (0 bytes free there): " in failed["error"]  # the file: its receipts, first
        assert str(out / "receipts" / "step_00000030.json") in failed["error"]
        # nothing moved: the policy, the lineage, the checkpointed state
        assert (json.dumps(gate.policy.state_dict(), sort_keys=True), [list(k) for k in gate.lineage]) == before
        assert {k: v for k, v in gate.state_dict().items() if k != "telemetry"} == {
            k: v for k, v in saved.items() if k != "telemetry"}                  # (load intervals: their own record)
        assert [r["step"] for r in read_history(out)] == [0, 10, 20]
        # the trackers hear at once, with what waits for the disk
        gate.delivery.wait(5.0)
        said = [a for a in tracker.alerts if a["level"] == "ERROR"]
        assert said and said[-1]["step"] == 30 and "record(s) of this run wait in memory" in said[-1]["text"]
        assert not read_lines(out / "errors.jsonl")                   # no room for it yet
        disk.room()
        _nudge(gate.model, 0.3, 40)
        live[40] = gate.run(40, loss=4.4)
    history = read_history(out)
    assert [r["step"] for r in history] == [0, 10, 20, 30, 40]      # the held gate, written whole, first
    errors = read_lines(out / "errors.jsonl")
    assert [e["step"] for e in errors] == [30] and "step_00000030.json" in errors[0]["error"]
    assert any(a["step"] == 30 and a["level"] == "ERROR" for a in read_lines(out / "alerts.jsonl"))
    assert _decisions(replay(history, AtlasConfig.coerce(CONFIG))) == _decisions(history)
    assert [list(k) for k in gate.lineage][-2:] == [[30, gate.branch], [40, gate.branch]]
    # a resume from the state checkpointed while the disk was full agrees with the record it resumes
    resumed = _gate(out)
    resumed.resume(20, saved)
    record = resumed.run(50, loss=4.3)
    assert record["stage_before_resume"] == history[2]["stage"]
    assert [r["step"] for r in read_history(out)] == [0, 10, 20, 50]


def test_a_line_cut_by_a_failed_write_is_repaired_from_memory_when_space_returns(tmp_path, caplog):
    out = tmp_path / "atlas"
    disk = Disk(out)
    gate = _gate(out)
    with disk.mounted():
        for step in (0, 10):
            gate.run(step, loss=4.0)
        disk.cut("gates.jsonl", after=300)                         # 300 bytes of gate 20's line reach the disk
        assert gate.run(20, loss=3.9)["status"] == "FAILED"
        assert (out / "gates.jsonl").read_bytes().endswith(b"\n")  # the cut part is taken back at once
        disk.room()
        with caplog.at_level(logging.WARNING, logger="atlas_tracking"):
            gate.step(21)                                          # the next call of the loop, no resume
    history = read_history(out)
    assert [r["step"] for r in history] == [0, 10, 20]
    held = history[-1]
    assert held["receipts_sha256"] and (out / "receipts" / "step_00000020.json").is_file()
    repaired = [m for m in caplog.messages if "repaired the record" in m]
    assert repaired and "step 20" in repaired[0] and "No space left on device" in repaired[0]
    assert not [m for m in caplog.messages if "crash" in m]
    assert gate.lineage[-1][0] == 20


def test_a_baseline_that_could_not_be_written_is_never_a_reference(tmp_path):
    out = tmp_path / "atlas"
    disk = Disk(out)
    gate = _gate(out)
    with disk.mounted():
        disk.cut("anchors.safetensors", after=0)                  # the step-0 baseline cannot be written
        first = gate.run(0, loss=4.0)
        disk.room()
        second = gate.run(10, loss=3.9)
        third = gate.run(20, loss=3.8)
    assert first.get("baseline_path") is None and "could not be written" in first["reference_fallback"]
    assert "no baseline is on disk: the next gate takes a new one" in first["reference_fallback"]
    assert second["baseline_path"].endswith(f"step_00000010.{gate.branch}")  # a new one, on disk
    assert "reference_fallback" in second and "reference_fallback" not in third
    for record in read_history(out):
        assert record.get("baseline_path") is None or (out / "baselines" / record["baseline_path"].rsplit("/", 1)[1]).is_dir()


def test_in_pretraining_a_gate_whose_baseline_failed_is_not_the_next_reference(tmp_path):
    out = tmp_path / "atlas"
    disk = Disk(out)
    config = {**CONFIG, "policy": {"phase": "pretraining"}}
    gate = _gate(out, config=config)
    with disk.mounted():
        gate.run(0, loss=4.0)
        at_ten = gate.run(10, loss=3.9)["baseline_path"]
        disk.cut("anchors.safetensors", after=0)
        twenty = gate.run(20, loss=3.8)
        disk.room()
        thirty = gate.run(30, loss=3.7)
    assert twenty["baseline_path"] == at_ten and at_ten in twenty["reference_fallback"]
    assert at_ten in thirty["reference_fallback"]                 # measured against step 10's, and says so
    assert thirty["baseline_path"].endswith(f"step_00000030.{gate.branch}")
    assert not (out / "baselines" / f"step_00000020.{gate.branch}").exists()


def test_the_plain_loop_trains_on_through_a_full_disk(tmp_path, caplog):
    out = tmp_path / "atlas"
    disk = Disk(out)
    gate = _gate(out, config={**CONFIG, "telemetry": {"enabled": True, "early_gate": False}})
    with disk.mounted():
        disk.fill()                                                # full before the run directory is claimed
        with caplog.at_level(logging.ERROR, logger="atlas_tracking"):
            failed = gate.run(0, loss=4.0)
            gate.step(1)
            gate.finish()                                          # backlog.json cannot be written either
    assert failed["status"] == "FAILED" and "run.json" in failed["error"] and "bytes free" in failed["error"]
    assert any("could not be written" in m or "gate failed" in m for m in caplog.messages)


def test_lightning_fit_trains_on_through_a_full_disk(tmp_path, recwarn):
    from integrations.lightning import AtlasCallback

    root = tmp_path / "run"
    out = root / "atlas"
    disk = Disk(out)
    train, val = tiny_data(steps=12)
    callback = AtlasCallback(tiny_canary(), {**QUIET, "gate": {"delivery_wait_s": 1.0}})

    class Fill(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            disk.fill()                                            # before the run directory is claimed

        def on_validation_end(self, trainer, pl_module):
            if trainer.global_step == 8:
                disk.room()

        def on_fit_end(self, trainer, pl_module):
            disk.fill()                                            # the backlog write at the end of fit fails

    trainer = pl.Trainer(default_root_dir=root, max_steps=12, val_check_interval=4, limit_val_batches=1,
                         callbacks=[Fill(), callback], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    with disk.mounted():
        trainer.fit(tiny_module(), train, val)
    assert trainer.global_step == 12
    assert [r["step"] for r in read_history(out)] == [8, 12]
    assert [e["step"] for e in read_lines(out / "errors.jsonl")] == [0, 4]     # written once the disk had room
    assert any("backlog could not be written" in str(w.message) and "bytes free" in str(w.message) for w in recwarn)


@pytest.fixture(scope="module")
def unsaved_reference(tmp_path_factory):
    """A run whose gates name a baseline that is not on disk (as the record was written before gates committed)."""
    out = tmp_path_factory.mktemp("unsaved") / "atlas"
    gate = _gate(out)
    for step in (0, 10):
        gate.run(step, loss=4.0)
    shutil.rmtree(read_history(out)[0]["baseline_path"])
    return out


@pytest.mark.parametrize("command", ["gates", "verify", "report", "du"])
def test_the_commands_flag_a_record_whose_reference_is_missing(unsaved_reference, tmp_path, command, capsys):
    from atlas_tracking.cli.app import main

    out = unsaved_reference
    args = {"report": ["report", str(out), "--out", str(tmp_path / "report.html")],
            "verify": ["verify", str(out / "receipts" / "step_00000010.json")]}.get(command, [command, str(out)])
    code = main(args)
    said = capsys.readouterr().out
    assert "reference missing: the gate at step 10 names step_00000000." in said, said
    assert code == (1 if command == "verify" else 0)


def test_load_intervals_the_disk_refuses_wait_in_memory_and_are_written_in_order(tmp_path, caplog):
    out = tmp_path / "atlas"
    disk = Disk(out)
    gate = _gate(out, config={**CONFIG, "telemetry": {"enabled": True, "early_gate": False, "every_n_steps": 2}})
    ids = torch.Generator().manual_seed(0)
    with disk.mounted():
        gate.run(0, loss=4.0)
        for step in range(1, 9):
            if step == 3:
                disk.fill()                                        # the intervals of steps 3-4 and 5-6 are refused
            if step == 7:
                disk.room()
            gate.model.train()(torch.randint(0, 64, (2, 16), generator=ids))   # a training forward
            with caplog.at_level(logging.ERROR, logger="atlas_tracking"):
                gate.step(step)
            if step == 6:
                assert [x["step"] for x in read_load(out)] == [2] and gate.held.waiting() >= 2
    assert [(x["first_step"], x["step"]) for x in read_load(out)] == [(1, 2), (3, 4), (5, 6), (7, 8)]
    assert all(sum(row["load"]) == 2 * (2 * 16) * 2 for x in read_load(out) for row in x["layers"])  # 2 forwards, top-2
    assert sum("waits in memory" in m for m in caplog.messages) == 2


@pytest.mark.parametrize("room", [True, False], ids=["room-at-resume", "still-full-at-resume"])
def test_a_resume_in_the_same_process_never_writes_what_waited_into_the_restored_history(tmp_path, caplog, room):
    out = tmp_path / "atlas"
    disk = Disk(out)
    gate = _gate(out, config={**CONFIG, "telemetry": {"enabled": True, "early_gate": False, "every_n_steps": 2}})
    ids = torch.Generator().manual_seed(0)

    def train(steps):
        for step in steps:
            gate.model.train()(torch.randint(0, 64, (2, 16), generator=ids))   # a training forward
            gate.step(step)

    with disk.mounted():
        gate.run(0, loss=4.0)
        train(range(1, 5))
        gate.run(4, loss=3.9)
        saved = gate.state_dict()                                  # the checkpoint of step 4
        disk.fill()
        train(range(5, 7))                                         # the interval of steps 5-6 waits in memory
        assert gate.run(6, loss=3.8)["status"] == "FAILED"         # and the gate of step 6, with its failure
        assert len(gate.held.gates) == 1 and gate.held.waiting() >= 3
        if room:
            disk.room()
        with caplog.at_level(logging.ERROR, logger="atlas_tracking"):
            gate.resume(4, saved)                                  # the same process goes back to step 4
        assert gate.held.waiting() == 0
        disk.room()
        train(range(5, 7))
        gate.run(6, loss=3.7)
    history = read_history(out)
    assert [(r["step"], r["resume"]) for r in history] == [(0, False), (4, False), (6, True)]
    assert [r["step"] for r in read_lines(out / "gates.jsonl")] == [0, 4, 6]       # the file itself, not only its reading
    assert [(x["first_step"], x["step"]) for x in read_load(out)] == [(1, 2), (3, 4), (5, 6)]
    assert [e["step"] for e in read_lines(out / "errors.jsonl")] == []
    parked = [(x["first_step"], x["step"]) for x in read_lines(out / "load.abandoned.jsonl")]
    if room:  # the abandoned segment's gate, interval and failure are filed with it
        assert [r["step"] for r in read_lines(out / "gates.abandoned.jsonl")] == [6] and parked == [(5, 6)]
        assert [e["step"] for e in read_lines(out / "errors.abandoned.jsonl")] == [6]
    else:     # lost, and the log says so
        assert not read_lines(out / "gates.abandoned.jsonl") and parked == []
        assert any("they are lost, not written into the restored history" in m for m in caplog.messages)
    assert _decisions(replay(history, AtlasConfig.coerce(CONFIG))) == _decisions(history)
