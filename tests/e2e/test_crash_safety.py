"""Crash safety in the suite (a few kills; ``python benchmarks/crash_safety.py --kills 30`` is the measurement):
SIGKILL inside a gate, during the record write and during tracker delivery, resume from the latest checkpoint."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_kills_never_corrupt_lose_or_duplicate_a_gate_and_the_trackers_catch_up(tmp_path, script):
    run = script("benchmarks/crash_safety.py").run

    result = run(tmp_path / "crash", kills=3, seed=1, kinds=("in_gate", "record_write", "delivery"))
    assert result["kills"] == {"random": 0, "in_gate": 1, "record_write": 1, "delivery": 1}
    assert result["finished_before_the_kill"] == 0 and result["final_exit_code"] == 0
    assert result["torn_gate_lines_seen_after_kills"] == 1  # the record-write kill left half a line on disk
    assert result["torn_lines_cut"] == 1  # ... cut off by the next resume, never read as a gate
    assert result["record_files_partial_or_corrupt_lines"] == 0 and result["temporary_leftovers"] == []
    assert result["history_monotone"] and result["history_gates"] >= 5
    assert result["acknowledged_lost"] == 0 and result["duplicated_in_record"] == 0
    assert result["receipts_not_matching_their_record"] == 0
    assert result["last_wandb_run_equals_history"] and result["last_mlflow_run_equals_history"]
    assert result["duplicate_steps_within_a_tracker_run"] == 0
