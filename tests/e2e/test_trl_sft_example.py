"""``examples/trl_sft.py`` end to end, shortened: pretraining with a plain Trainer, SFT with TRL's SFTTrainer and the
callback, W&B offline and MLflow on sqlite read back, the gate time beside the Trainer's evaluation time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_trl_sft_example_runs_as_the_readme_says(tmp_path):
    # one thread: beside other test processes, two threads per process on 2 cores slowed this run 7-fold
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_sft.py"), "--quick", "--out",
                           str(tmp_path / "out"), "--pretrained", str(tmp_path / "absent")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [g["step"] for g in summary["gates"]] == [0, 10, 20] and summary["gates"][0]["status"] == "BASELINE"
    cost = summary["gate_cost"]
    assert [r["step"] for r in cost["per_gate"] if r["eval_s"] is not None] == [10, 20]
    assert cost["gates_s"] > 0 and cost["evaluations_s"] > 0 and cost["monitoring_s"] >= cost["gates_s"]
    assert cost["canary_tokens"] == 16 * 128
    trackers = summary["trackers"]
    assert trackers["wandb"]["atlas_steps"] == [0, 10, 20] and trackers["wandb"]["eval_loss_steps"] == [10, 20]
    assert trackers["mlflow"]["atlas/c2 steps"] == [0, 10, 20] and trackers["mlflow"]["gate artifacts"] == 3
    assert "gate time vs the Trainer's evaluation time" in proc.stdout
