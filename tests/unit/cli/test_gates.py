"""``atlas-tracking gates`` prints a run's gates, failed gates and tracker backlog; every command that reads a
run says once that it dropped a last line cut short by a crash."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from atlas_tracking.cli import main
from atlas_tracking.gate import AtlasGate
from atlas_tracking.testing.tiny import POST_TRAINING, tiny_canary, tiny_module


class TrackerDownAfter:
    """A tracker run that receives gates up to ``last_step`` and then cannot be reached."""

    name = "tracker"
    run_key = "run-1"

    def __init__(self, last_step: int):
        self.last_step = last_step

    def log_gate(self, record, metrics, step):
        if step > self.last_step:
            raise ConnectionError("server down")

    def alert(self, event):
        pass

    def finish(self):
        pass


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "atlas"
    gate = AtlasGate(tiny_module().model, tiny_canary(), POST_TRAINING, out_dir=out, sinks=[TrackerDownAfter(10)],
                     )
    gate.delivery.warn = lambda message: None
    for step, loss in [(0, 5.0), (10, 4.9), (20, 4.8)]:
        gate.run(step, loss=loss)
    gate.record_failure(30, RuntimeError("out of memory"))
    gate.delivery.wait()  # tracker calls run on a background queue
    return out


def test_gates_prints_the_table_the_failed_gates_and_the_backlog(run_dir, capsys):
    assert main(["gates", str(run_dir)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert [line.split(":")[0] for line in lines[:3]] == ["verdict", "where", "what to do"]  # the last gate first
    lines = lines[lines.index("") + 1:]  # then the table
    assert lines[0].split()[:3] == ["step", "loss", "c2"] and "status" in lines[0] and "stage" in lines[0]
    assert [line.split()[0] for line in lines[2:5]] == ["0", "10", "20"]
    assert "BASELINE" in lines[2] and "post_training" in lines[2]
    assert "failed gates: 1" in text and "step 30: RuntimeError: out of memory" in text
    assert "not yet delivered: tracker (run run-1): 1 gate(s), steps 20" in text

    assert main(["gates", str(run_dir), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [row[0] for row in summary["rows"]] == [0, 10, 20]
    assert summary["failed"] == [{"step": 30, "branch": summary["failed"][0]["branch"],
                                  "error": "RuntimeError: out of memory"}]
    assert summary["backlog"] == {"tracker": {"run": "run-1", "missing_steps": [20]}}


def test_gates_on_a_directory_without_a_record_is_one_line_exit_2(tmp_path, capsys):
    assert main(["gates", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no gates.jsonl under" in err and len(err.splitlines()) == 1


def test_every_reader_says_once_what_a_cut_last_line_dropped(run_dir, tmp_path, caplog, capsys):
    torn = tmp_path / "torn"
    shutil.copytree(run_dir, torn)
    line = (run_dir / "gates.jsonl").read_text().splitlines()[-1].replace('"step":20', '"step":40')
    with open(torn / "gates.jsonl", "a") as fh:
        fh.write(line[: len(line) // 2])  # a crash cut the write of gate 40
    commands = {
        "replay": ["replay", str(torn / "gates.jsonl")],
        "protect": ["protect", str(torn)],
        "report": ["report", str(torn), "--out", str(tmp_path / "report.html")],
        "judge": ["judge", "--stressed", str(torn), "--candidate", str(run_dir)],
        "gates": ["gates", str(torn)],
    }
    for name, argv in commands.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="atlas_tracking"):
            assert main(argv) in (0, 1), name
        said = [r.getMessage() for r in caplog.records if "cut short by a crash" in r.getMessage()]
        assert len(said) == 1, (name, said)
        assert "step 40" in said[0] and str(torn / "gates.jsonl") in said[0]
    capsys.readouterr()
