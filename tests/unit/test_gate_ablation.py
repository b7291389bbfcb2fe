"""``benchmarks/gate_ablation.py``: each part's stand-in takes the place of that part in a gate (its receipts read the
stand-in's zeros), a gate runs with every part stood in for, and the engine's functions are its own again after."""

from __future__ import annotations

import contextlib

import pytest

from atlas_tracking import AtlasConfig, Canary, measure
from atlas_tracking.testing.demo import demo_canary
from atlas_tracking.testing.lightning_lm import build_qwen3_moe


@pytest.fixture(scope="module")
def gate_inputs():
    model = build_qwen3_moe(seed=0, hidden=32, layers=2, experts=8, top_k=2, aux_coef=0.0).eval()
    canary = Canary.from_token_ids(demo_canary().windows.reshape(-1), window=32, n_windows=4, seed=0)
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "kernels": "eager", "batch_windows": 2}})
    return model, canary, cfg


def _layer(gate_inputs, bench=None, part=None):
    model, canary, cfg = gate_inputs
    with bench.standing_in(part) if part else contextlib.nullcontext():
        return measure(model, canary, config=cfg, keep_anchors=False).layers[0]


def test_each_stand_in_replaces_its_part_and_the_engine_is_restored(script, gate_inputs):
    bench = script("benchmarks/gate_ablation.py")
    owners = [(owner, name) for stand_ins in bench.STAND_INS.values() for owner, name, _ in stand_ins]
    originals = [getattr(owner, name) for owner, name in owners]
    real = _layer(gate_inputs)
    receipts = real["receipts"]
    assert receipts["c2"] != 0 and receipts["ov_cf"] > 0.5 and receipts["d_adjacent_interior"] < 0.99
    assert real["selfcheck"]["gain"] is not None and receipts["margin_mean"] is not None
    assert _layer(gate_inputs, bench, "chunk")["receipts"]["c2"] == 0  # the stand-in's zero C2
    pairs = _layer(gate_inputs, bench, "pairs")["receipts"]
    assert pairs["d_adjacent_interior"] == pytest.approx(1.0, abs=1e-4)  # zero competitors: D = |v| / (|v| + eps)
    assert _layer(gate_inputs, bench, "reroute")["receipts"]["ov_cf"] < receipts["ov_cf"]  # re-routed to expert 0
    assert _layer(gate_inputs, bench, "compute")["receipts"]["margin_mean"] is None  # no per-window sums
    assert _layer(gate_inputs, bench, "observe")["selfcheck"]["gain"] is None  # no comparisons
    every = _layer(gate_inputs, bench, "all")
    assert every["receipts"]["margin_mean"] is None and every["selfcheck"]["gain"] is None
    assert [getattr(owner, name) for owner, name in owners] == originals
