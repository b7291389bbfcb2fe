"""``gate_share``: a gate's wall time over the stretch since the same process last read a gate, the share of
training time that gating this often costs (docs/trackers.md)."""

from __future__ import annotations

import time

from atlas_tracking.artifacts.history import read_history
from atlas_tracking.artifacts.record import gate_metrics
from atlas_tracking.gate import AtlasGate
from atlas_tracking.testing.lightning_lm import build_qwen3_moe
from atlas_tracking.testing.tiny import tiny_canary
from atlas_tracking.viz.gate_table import format_run_gates, run_gates

CFG = {"receipts": {"progress": False}}
TRAINING_S = 0.4
"""What stands in for the training between two gates: a sleep the stretch holds whole."""


def test_the_share_is_the_gate_over_the_stretch_since_the_last_gate_this_process_read(tmp_path):
    model, canary = build_qwen3_moe(hidden=32, layers=2, experts=8).eval(), tiny_canary()
    gate = AtlasGate(model, canary, CFG, out_dir=tmp_path)
    start = time.perf_counter()
    first = gate.run(step=0, loss=4.0)
    time.sleep(TRAINING_S)
    second = gate.run(step=10, loss=3.9)
    wall = time.perf_counter() - start
    assert "gate_share" not in first and "atlas/gate_share" not in gate_metrics(first)
    seconds = second["gate_seconds"]
    # the stretch holds the sleep and the second gate, and lies within both calls: exact bounds, no timing guess
    assert seconds / wall <= second["gate_share"] <= seconds / (TRAINING_S + seconds) < 1
    assert gate_metrics(second)["atlas/gate_share"] == second["gate_share"]
    assert read_history(tmp_path)[-1]["gate_share"] == second["gate_share"]  # the local record holds it

    # another process (a resume): its first gate has no stretch of its own, and is not given the last one's
    again = AtlasGate(model, canary, CFG, out_dir=tmp_path)
    again.resume(10, gate.state_dict())
    time.sleep(TRAINING_S)
    third = again.run(step=20, loss=3.8)
    assert "gate_share" not in third

    # what `atlas-tracking gates` says of the run's cost: the record's own figures, nothing measured again
    summary = run_gates(tmp_path)
    assert summary["cost"] == {"gates": 3, "seconds": sum(r["gate_seconds"] for r in (first, second, third)),
                    "share_median": second["gate_share"], "share_last": second["gate_share"]}
    assert f"last {100 * second['gate_share']:.2f}%" in format_run_gates(summary)
