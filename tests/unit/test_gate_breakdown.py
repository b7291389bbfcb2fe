"""``benchmarks/gate_breakdown.py``: its timers give each part once (an inner call is not counted again in the outer
one), every part of a gate shows, and the engine's functions are its own again after the run."""

from __future__ import annotations

import time

import torch

from atlas_tracking import AtlasConfig, Canary, measure
from atlas_tracking.testing.demo import demo_canary
from atlas_tracking.testing.lightning_lm import build_qwen3_moe

GATE_PARTS = {"experts", "field_arithmetic", "reroute_ov_cf", "selfcheck", "receipts_per_window", "selection",
              "report"}


def _busy(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_nested_parts_are_counted_once(script):
    bench = script("benchmarks/gate_breakdown.py")
    timer = bench.PartTimer()
    inner = timer.wrap("inner", lambda: _busy(0.02))
    outer = timer.wrap("outer", lambda: (_busy(0.01), inner()))
    parts = timer.run(lambda: (outer(), _busy(0.01)))
    assert parts["inner"] >= 0.02 and 0.01 <= parts["outer"] < 0.02
    assert parts["rest"] >= 0.01
    assert abs(parts["inner"] + parts["outer"] + parts["rest"] - parts["total"]) < 1e-9


def test_a_gate_shows_every_part_and_the_engine_is_restored(script):
    bench = script("benchmarks/gate_breakdown.py")
    originals = [owner.__dict__[name] for owner, name, _ in bench.PARTS]
    model = build_qwen3_moe(seed=0, hidden=32, layers=2, experts=8, top_k=2, aux_coef=0.0).eval()
    canary = Canary.from_token_ids(demo_canary().windows.reshape(-1), window=32, n_windows=4, seed=0)
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "kernels": "eager", "batch_windows": 2}})
    timer = bench.PartTimer()
    with bench.instrumented(timer):
        parts = timer.run(lambda: measure(model, canary, config=cfg, keep_anchors=False))
    assert set(parts) >= GATE_PARTS, sorted(parts)
    assert all(seconds >= 0 for seconds in parts.values())
    assert [owner.__dict__[name] for owner, name, _ in bench.PARTS] == originals
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    with torch.no_grad():
        ids = torch.as_tensor(canary.windows[:2], dtype=torch.long)
        own = timer.run(lambda: bench.own_experts_timed(timer, experts, lambda: model(input_ids=ids, use_cache=False)))
    assert own.get("experts_own", 0) > 0
    assert all("forward" not in m.__dict__ for m in experts)  # the experts' own forward again
