"""``benchmarks/gate_ops.py``: per-pass operator counts and self times from real profiler events, the extra of one
pass over another, and the costliest shapes of an operator."""

from __future__ import annotations

import pytest
import torch


def test_operator_counts_and_extra_time_come_from_the_profiled_passes(script):
    bench = script("benchmarks/gate_ops.py")
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    once = bench.profiled(lambda: torch.mm(a, b))
    gate_passes = [bench.profiled(lambda: [torch.mm(a, b) for _ in range(3)] + [torch.mm(b.T, a.T)]) for _ in range(2)]
    forward = bench.per_pass(once.key_averages(), passes=1)
    gate = bench.per_pass([e for p in gate_passes for e in p.key_averages()], passes=2)
    assert gate["aten::mm"][0] == 4.0 and forward["aten::mm"][0] == 1.0  # per pass, over the two passes
    row = next(r for r in bench.operator_table(gate, forward, top=50) if r["operator"] == "aten::mm")
    assert row["gate_calls"] == 4.0 and row["forward_calls"] == 1.0
    # each figure is rounded to 0.01 ms on its own, so their difference is within two roundings of the extra
    assert row["extra_ms"] == pytest.approx(row["gate_ms"] - row["forward_ms"], abs=0.011) and row["gate_ms"] > 0
    totals = bench.per_pass([e for p in gate_passes for e in p.key_averages(group_by_input_shape=True)], passes=2,
                            by_shape=True)
    shapes = bench.costliest_shapes(totals, "aten::mm")
    assert sorted((s["input_shapes"], s["calls"]) for s in shapes) == [("[[16, 32], [32, 64]]", 1.0),
                                                                       ("[[64, 32], [32, 16]]", 3.0)]
