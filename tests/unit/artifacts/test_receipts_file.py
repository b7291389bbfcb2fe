"""The receipts artifact in its two forms: the safetensors form loads to exactly the JSON form's document, every
reader reads both, a broken binary artifact is a clear error, and a gate chooses its form by size."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load

from atlas_tracking.artifacts.gate_report import ArtifactError, read_artifact, verify
from atlas_tracking.artifacts.handoff_reference import HandoffReference
from atlas_tracking.artifacts.history import read_history, read_lines
from atlas_tracking.artifacts.receipts_file import decode, encode, split
from atlas_tracking.artifacts.run_dir import RunDir
from atlas_tracking.cli import main
from atlas_tracking.gate import AtlasGate
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.tiny import QUIET, random_canary, tiny_canary, tiny_module

COMPACT = {"separators": (",", ":"), "allow_nan": False}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint measured twice by ``atlas-tracking measure``: ``--out r.json`` and
    ``--out r.safetensors``."""
    root = tmp_path_factory.mktemp("measured")
    family_model("qwen3_moe").save_pretrained(root / "model")
    random_canary().save(root / "canary.npz")
    for name in ("r.json", "r.safetensors"):
        argv = ["measure", "--model", str(root / "model"), "--canary", str(root / "canary.npz"), "--out",
                str(root / name), "--step", "7", "--quiet"]
        assert main(argv) == 0
    return root


def test_the_binary_form_loads_to_exactly_the_json_document(measured, capsys):
    text = (measured / "r.json").read_text()
    assert text.startswith("{")                                      # --out X.json: JSON, as the user named it
    binary = read_artifact(measured / "r.safetensors")
    assert binary == json.loads(text) and json.dumps(binary, **COMPACT) == text  # every number, every key order
    tensors = load((measured / "r.safetensors").read_bytes())
    assert tensors["per_window/layers/0/load"].dtype.kind in "ui"              # counts as integers
    assert tensors["per_window/layers/0/transition_jump"].dtype == np.float32  # computed in float32
    capsys.readouterr()
    assert main(["show", str(measured / "r.safetensors")]) == 0                # an operator reads it as JSON
    assert capsys.readouterr().out == text + "\n"
    assert main(["show", str(measured / "r.json"), "--out", str(measured / "c.safetensors")]) == 0
    assert read_artifact(measured / "c.safetensors") == json.loads(text)
    assert main(["report", str(measured / "r.safetensors"), "--out", str(measured / "r.html")]) == 0
    assert "model.layers.0" in (measured / "r.html").read_text()


def test_each_value_keeps_its_exact_number_and_type():
    doc = {"kind": "k", "per_window": {"f32": [[0.5, -0.0], [None, 3.25]], "f64": [0.1, 1e300],
                                       "i32": [0, -(2 ** 31)], "i64": [2 ** 40, 1], "mixed": [1, 2.5],
                                       "u8": [0, 255], "i16": [-129, 3], "a/b": {"c": [1]},
                                       "a": {"b": [[0], {"x": 1}]},
                                       "flags": [True, False], "empty": [], "ragged": [[1, 2], [3]], "n": 3}}
    _, tensors = split(doc)
    assert {k: str(v.dtype) for k, v in tensors.items()} == {
        "per_window/f32": "float32", "per_window/f64": "float64", "per_window/i32": "int32",
        "per_window/i64": "int64", "per_window/u8": "uint8", "per_window/i16": "int16",
        "per_window/ragged/0": "uint8", "per_window/ragged/1": "uint8", "per_window/a/b/0": "uint8"}
    back = decode(encode(doc, "safetensors", 0)[1], "x.safetensors")
    assert back == doc and json.dumps(back) == json.dumps(doc)
    assert [type(v) for v in back["per_window"]["mixed"]] == [int, float]


def test_verify_passes_on_a_binary_artifact_and_fails_with_exit_2_when_it_is_broken(measured, tmp_path, capsys):
    good = measured / "r.safetensors"
    assert verify(read_artifact(good)) == []
    capsys.readouterr()
    assert main(["verify", str(good)]) == 0
    assert "safetensors form" in capsys.readouterr().out
    raw = good.read_bytes()
    header = 8 + int.from_bytes(raw[:8], "little")
    cases = {"half.safetensors": (raw[: len(raw) // 2], "truncated"),
             "head.safetensors": (raw[:5], "truncated"),
             "header.safetensors": (raw[:40] + b"\xff" + raw[41:], "corrupted"),
             "data.safetensors": (raw[: header + 10], "truncated")}
    for name, (data, needle) in cases.items():
        (tmp_path / name).write_bytes(data)
        assert main(["verify", str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err and name in err, err
        with pytest.raises(ArtifactError):
            read_artifact(tmp_path / name)


def _binary_run(out: Path, steps: tuple[int, ...], gate: dict | None = None) -> AtlasGate:
    config = {**QUIET, "gate": {"receipts_binary_above": 100, **(gate or {})}}
    atlas = AtlasGate(tiny_module().model, tiny_canary(), config, out_dir=out)
    for step in steps:
        atlas.run(step, loss=4.0)
    return atlas


@pytest.fixture(scope="module")
def binary_run(tmp_path_factory):
    """A run whose gates go binary: ``receipts_format: auto`` with a threshold below the tiny layout's size."""
    out = tmp_path_factory.mktemp("binary") / "atlas"
    _binary_run(out, (0, 10, 20))
    return out


def test_auto_writes_json_for_a_small_layout_and_safetensors_above_the_threshold(binary_run, tmp_path):
    small = tmp_path / "small"
    AtlasGate(tiny_module().model, tiny_canary(), QUIET, out_dir=small).run(0, loss=4.0)
    assert [p.name for p in (small / "receipts").iterdir()] == ["step_00000000.json"]
    text = (small / "receipts" / "step_00000000.json").read_text()       # the JSON text small runs always wrote
    assert text == json.dumps(read_artifact(small / "receipts" / "step_00000000.json"), **COMPACT)
    forced = tmp_path / "forced"
    _binary_run(forced, (0,), {"receipts_format": "json"})
    assert [p.name for p in (forced / "receipts").iterdir()] == ["step_00000000.json"]
    assert sorted(p.name for p in (binary_run / "receipts").iterdir()) == [
        "step_00000000.safetensors", "step_00000010.safetensors", "step_00000020.safetensors"]
    run = RunDir(binary_run)
    for rec in read_history(binary_run):                 # the record holds the sha256 of the file's bytes
        assert hashlib.sha256(run.receipts_file(rec["step"]).read_bytes()).hexdigest() == rec["receipts_sha256"]


def test_du_counts_binary_artifacts(binary_run, capsys):
    capsys.readouterr()
    assert main(["du", str(binary_run), "--json"]) == 0
    usage = json.loads(capsys.readouterr().out)
    assert usage["receipts_files"] == 3
    assert usage["bytes"]["receipts"] == sum(p.stat().st_size for p in (binary_run / "receipts").iterdir())


def test_a_corrupted_binary_artifact_fails_its_checksum_and_is_set_aside(binary_run, tmp_path):
    shutil.copytree(binary_run, tmp_path / "atlas")
    run = RunDir(tmp_path / "atlas")
    path = run.receipts_file(20)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40                                      # one bit of a tensor: still a readable file
    path.write_bytes(bytes(raw))
    lineage = [[r["step"], r["branch"]] for r in read_history(run.path)]
    run.rewind(20, lineage=lineage, branch=lineage[-1][1])
    assert not path.exists()
    parked = [p.name for p in (run.receipts / "abandoned").iterdir()]
    assert len(parked) == 1 and parked[0].startswith("step_00000020.unacknowledged.")
    assert parked[0].endswith(".safetensors")


def test_the_handoff_reference_and_a_rebuilt_gate_read_a_binary_artifact(binary_run, measured, tmp_path):
    binary = HandoffReference.load(measured / "r.safetensors")
    text = HandoffReference.load(measured / "r.json")
    assert (binary.step, binary.layers, binary.model) == (text.step, text.layers, text.model) and binary.step == 7
    atlas = AtlasGate(tiny_module().model, tiny_canary(),
                      {**QUIET, "lifecycle": {"handoff_reference": "gate:0"}, "policy": {"phase": "pretraining"},
                       "gate": {"receipts_format": "safetensors"}}, out_dir=tmp_path / "own")
    atlas.run(0, loss=4.0)
    record = atlas.run(10, loss=4.0)
    assert record["handoff_reference"].endswith("step_00000000.safetensors")
    shutil.copytree(binary_run, tmp_path / "atlas")
    run = RunDir(tmp_path / "atlas")
    lines = run.gates.read_text().splitlines()
    whole = json.loads(lines[-1])
    run.gates.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    assert run.repair()["cut_gates_rebuilt"] == 1
    rebuilt = read_history(run.path)[-1]
    assert "rebuilt at a resume from step_00000020.safetensors (" in rebuilt["rebuilt"]
    assert rebuilt["receipts_sha256"] == whole["receipts_sha256"] and rebuilt["layers"] == whole["layers"]


def test_retention_prunes_binary_artifacts(tmp_path, capsys):
    out = tmp_path / "atlas"
    _binary_run(out, (0, 10, 20, 30), {"keep_receipts": 2})
    assert sorted(p.name for p in (out / "receipts").iterdir()) == ["step_00000020.safetensors",
                                                                     "step_00000030.safetensors"]
    pruned = [r.get("pruned_receipts") for r in read_lines(out / "gates.jsonl")]
    assert pruned == [None, None, ["receipts/step_00000000.safetensors"], ["receipts/step_00000010.safetensors"]]
    assert main(["verify", str(out / "receipts" / "step_00000000.safetensors")]) == 2
    assert "pruned by retention (gate.keep_receipts) at the gate of step 20" in capsys.readouterr().err


def test_a_gate_written_in_another_form_at_the_same_step_is_set_aside(tmp_path):
    run = RunDir(tmp_path)
    run.receipts.mkdir()
    run.receipts_file(0, "json").write_text("{}")
    assert run.receipts_file(0) == run.receipts / "step_00000000.json"
    target = run.receipts_target(0, "safetensors")
    assert target == run.receipts / "step_00000000.safetensors" and not run.receipts_file(0, "json").exists()
    parked = [p.name for p in (run.receipts / "abandoned").iterdir()]
    assert parked == [f"step_00000000.unacknowledged.{hashlib.sha256(b'{}').hexdigest()[:12]}.json"]
    target.write_bytes(b"x")
    assert run.receipts_file(0) == target and run.receipts_target(0, "safetensors") == target
