"""Crash safety in the suite (a few kills, two seeds; ``python benchmarks/crash_safety.py --kills 30 --seeds 7 11``
is the measurement): SIGKILL inside a gate, during the record write and during tracker delivery, resume from the
latest checkpoint."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_kills_never_corrupt_lose_or_duplicate_a_gate_and_the_trackers_catch_up(tmp_path, script):
    soak = script("benchmarks/crash_safety.py").run_seeds

    result = soak(tmp_path / "crash", kills=3, seeds=[1, 11], jobs=2, kinds=("in_gate", "record_write", "delivery"))
    assert result["totals"] == {"acknowledged_lost": 0, "duplicated_in_record": 0,
                                "receipts_not_matching_their_record": 0, "record_files_partial_or_corrupt_lines": 0,
                                "duplicate_steps_within_a_tracker_run": 0}
    assert result["every_seed_matches_its_trackers"]
    for seed, counts in result["seeds"].items():
        assert counts["kills"] == {"random": 0, "in_gate": 1, "record_write": 1, "delivery": 1}, seed
        assert counts["finished_before_the_kill"] == 0 and counts["final_exit_code"] == 0, seed
        assert counts["torn_gate_lines_seen_after_kills"] == 1, seed  # the record-write kill left half a line
        assert counts["torn_lines_cut"] == 1, seed  # ... cut off by the next resume, never read as a gate
        assert counts["temporary_leftovers"] == [], seed
        assert counts["history_monotone"] and counts["history_gates"] >= 5, seed
        assert counts["steps_whose_receipts_do_not_match"] == [], seed  # every history gate's file, by sha256
