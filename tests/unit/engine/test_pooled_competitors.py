"""On the CPU a gate evaluates each layer's competitors in one pooled call of its experts (engine/pooled_competitors.py):
the receipts are those of a call per micro-batch within the receipts' tolerance, every kept micro-batch's competitors
are in the call, a small memory budget evaluates them earlier, and a pool left unevaluated fails the gate."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from atlas_tracking import AtlasConfig, Canary, measure
from atlas_tracking.adapters.grouped_experts import interleaves, pair_fields
from atlas_tracking.adapters.hf import HFLayer
from atlas_tracking.engine import capture
from atlas_tracking.engine import measure as measure_module
from atlas_tracking.engine.pooled_competitors import pool_budget
from atlas_tracking.receipts.state1 import boundary_count
from atlas_tracking.testing.lightning_lm import build_qwen3_moe
from atlas_tracking.testing.tolerance import assert_within_tolerance

WINDOWS, WINDOW, BATCH = 8, 24, 2
CFG = AtlasConfig.from_dict({"receipts": {"progress": False, "n_bootstrap": 200, "batch_windows": BATCH,
                                          "kernels": "eager"}})


@pytest.fixture(scope="module")
def model():
    return build_qwen3_moe(seed=1, hidden=32, layers=2, experts=8, top_k=2).eval()


@pytest.fixture(scope="module")
def canary():
    ids = np.random.default_rng(0).integers(0, 64, 4000)
    return Canary.from_token_ids(ids, window=WINDOW, n_windows=WINDOWS, seed=0)


def _counted(monkeypatch) -> list[int]:
    """Rows of every pooled call of the experts, in call order."""
    rows: list[int] = []
    real = HFLayer.grouped_pair_outputs

    def counted(self, pairs):
        rows.append(sum(len(r) for r, _ in pairs))
        return real(self, pairs)

    monkeypatch.setattr(HFLayer, "grouped_pair_outputs", counted)
    return rows


def _unpooled(model, canary, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(capture.LayerCapture, "_pools", lambda self, device: False)
        return measure(model, canary, config=CFG, keep_anchors=False)


def test_one_pooled_call_per_layer_holds_every_micro_batch_and_the_receipts_hold(model, canary, monkeypatch):
    unpooled = _unpooled(model, canary, monkeypatch)
    rows = _counted(monkeypatch)
    pooled = measure(model, canary, config=CFG, keep_anchors=False)
    candidates = boundary_count(WINDOW, CFG.receipts.boundary_q)  # random competitors per window
    assert rows == [WINDOWS * (WINDOW + candidates)] * 2  # two routed layers, every window's competitors in one call
    devs = assert_within_tolerance(json.loads(pooled.to_json()), json.loads(unpooled.to_json()))
    for key in ("d_adjacent_boundary", "d_adjacent_interior", "d_random_boundary", "transition_incompat"):
        assert key in devs and all(layer["receipts"][key] is not None for layer in pooled.layers)
    for a, b in zip(pooled.per_window["layers"], unpooled.per_window["layers"]):  # the per-window sums themselves
        for key in ("d_adjacent_boundary", "d_adjacent_interior", "d_random_boundary"):
            assert np.allclose(a[key]["sum"], b[key]["sum"], atol=1e-5), key
            assert np.array_equal(a[key]["count"], b[key]["count"]), key
        assert len(a["transition_jump"]) == WINDOWS
        assert np.allclose(np.concatenate(a["transition_jump"]), np.concatenate(b["transition_jump"]), atol=1e-5)


def test_a_pool_at_its_budget_is_evaluated_at_once(model, canary, monkeypatch):
    monkeypatch.setattr(measure_module, "pool_budget", lambda free, layers: 1)  # every micro-batch fills it
    rows = _counted(monkeypatch)
    early = measure(model, canary, config=CFG, keep_anchors=False)
    assert rows == [BATCH * (WINDOW + boundary_count(WINDOW, CFG.receipts.boundary_q))] * (2 * WINDOWS // BATCH)
    assert_within_tolerance(json.loads(early.to_json()),
                            json.loads(_unpooled(model, canary, monkeypatch).to_json()))


def test_a_pool_left_unevaluated_fails_the_gate(model, canary, monkeypatch):
    monkeypatch.setattr(capture.LayerCapture, "_flush_pool", lambda self: None)
    with pytest.raises(RuntimeError, match="competitors were not evaluated"):
        measure(model, canary, config=CFG, keep_anchors=False)


def test_no_pool_unfused_for_wide_experts_or_without_a_budget(model, canary, monkeypatch):
    assert pool_budget(None, 4) is None  # free memory unknown: a call per micro-batch
    rows = _counted(monkeypatch)
    cfg = AtlasConfig.from_dict({"receipts": {**CFG.to_dict()["receipts"], "fuse_experts": False}})
    measure(model, canary, config=cfg, keep_anchors=False)  # unfused: the competitors ride in the pair calls
    wide = build_qwen3_moe(seed=1, hidden=128, layers=1, experts=4, top_k=2).eval()  # 128 KiB an expert: interleaved
    assert interleaves(wide.model.layers[0].mlp.experts) and not interleaves(model.model.layers[0].mlp.experts)
    measure(wide, canary, config=CFG, keep_anchors=False)  # in the active set's pass, expert by expert
    assert rows == []


def test_pair_fields_are_the_experts_own_call_of_those_rows(model):
    experts = model.model.layers[0].mlp.experts
    torch.manual_seed(0)
    rows, e = torch.randn(40, 32), torch.randint(0, 8, (40, 1))
    rand_rows, rand_e = torch.randn(7, 32), torch.randint(0, 8, (7, 1))
    u, v = pair_fields(experts, [(rows, e), (rand_rows, rand_e)])
    own = experts(torch.cat([rows, rand_rows]), torch.cat([e, rand_e]), torch.ones(47, 1))
    assert torch.equal(torch.cat([u[:, 0], v[:, 0]]), own)  # one call of the experts: the same products
