"""What a new user tries first works: ``atlas-tracking report RUN`` (no ``--out``) writes ``RUN/atlas/report.html`` and
prints its path; and the record's ``baseline_path`` resolves from any working directory, though the run was written
under a relative one. One real gate pair on a tiny Qwen3-MoE, run from a relative ``out_dir``."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from atlas_tracking import Canary
from atlas_tracking.artifacts.history import read_history
from atlas_tracking.cli.app import main
from atlas_tracking.gate import AtlasGate


@pytest.fixture(scope="module")
def run_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cwd")
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2))
    canary = Canary.from_token_ids(np.arange(2000) % 64, window=32, n_windows=4, seed=0)
    before = Path.cwd()
    os.chdir(root)  # the training process writes under a relative run directory
    try:
        gate = AtlasGate(model, canary, {"receipts": {"progress": False}, "policy": {"phase": "post_training"}},
                         out_dir="run/atlas")
        gate.run(step=0, loss=4.0)
        gate.run(step=10, loss=3.9)
    finally:
        os.chdir(before)
    return root / "run"


def test_report_without_out_writes_beside_the_gates_and_prints_the_path(run_root, capsys):
    assert main(["report", str(run_root)]) == 0
    out = run_root / "atlas" / "report.html"
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert out.read_text().startswith("<!doctype html>")
    # the atlas directory itself, and --out still wins
    assert main(["report", str(run_root / "atlas"), "--out", str(run_root / "elsewhere.html")]) == 0
    assert (run_root / "elsewhere.html").is_file()


def test_the_baseline_path_resolves_from_another_working_directory(run_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    records = read_history(run_root / "atlas")
    paths = {r["baseline_path"] for r in records if "baseline_path" in r}
    assert paths and all(Path(p).is_absolute() and Path(p).is_dir() for p in paths), paths
    assert all(Path(p).is_relative_to(run_root.resolve()) for p in paths)
