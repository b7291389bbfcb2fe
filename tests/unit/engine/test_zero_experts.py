"""Zero-computation experts (LongCat-Flash's identity slots) carry no field (docs/receipts.md#zero-computation-experts).

On a tiny random LongCat-Flash model: the gate's ``c2`` equals a plain-numpy loop that leaves zero experts out of the
co-active pairs (and counts only tokens with two field-carrying active experts); with a router bias that sends every
token to the zero experts, no pair, no V2 distance and no content drift is formed, and every exclusion is counted.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atlas_tracking import Baseline, Canary, measure
from atlas_tracking.artifacts.gate_report import verify
from atlas_tracking.testing.families import CFG, capture_layers, family_model
from atlas_tracking.testing.numpy_reference import c2_loop

CANARY = Canary.from_token_ids(np.arange(400) * 7 % 64, window=16, n_windows=4, seed=0)


@pytest.fixture(scope="module")
def model():
    return family_model("longcat_flash")


def test_the_adapter_names_the_identity_slots(model):
    from atlas_tracking.adapters import find_routed_layers

    for lay in find_routed_layers(model):
        assert lay.zero_experts == frozenset({8, 9}) and lay.num_experts == 10


def test_c2_leaves_zero_experts_out_of_the_pairs(model):
    report = measure(model, CANARY, config=CFG)
    assert verify(report.to_dict()) == []
    layers, seen = capture_layers(model, torch.as_tensor(CANARY.windows))
    cfg = CFG.receipts
    for lay, layer, pw in zip(layers, report.layers, report.to_dict()["per_window"]["layers"]):
        d = seen[lay.name]
        g = d["g"].reshape(-1, d["g"].shape[-1])
        routing = lay.routing(d["router"], g)
        with torch.no_grad():
            u = lay.expert_outputs(g, routing.active).double().numpy()
        x = d["x"].reshape(len(g), -1).double().numpy()
        norm = np.linalg.norm(x, axis=1, keepdims=True)
        zh = np.divide(x, norm, out=np.zeros_like(x), where=norm > 0)  # zero rows stay zero (receipts/geometry.py)
        active = routing.active.numpy()
        fields = ~np.isin(active, sorted(lay.zero_experts))
        ref = [c for c in c2_loop(u, zh, routing.rho.double().numpy(),
                                  routing.scores.gather(1, routing.active).double().numpy(), cfg.beta_adj,
                                  cfg.eps_kappa, fields) if c is not None]
        assert 0 < len(ref) < len(g)  # some tokens have a zero expert as one of their two: no pair
        assert int(np.sum(pw["c2"]["count"])) == len(ref), lay.name
        assert layer["receipts"]["c2"] == pytest.approx(float(np.mean(ref)), abs=1e-4), lay.name
        assert -1.0 <= layer["receipts"]["c2"] <= 1.0
        assert layer["receipts"]["zero_expert_pairs"] > 0


def _biased(model, bias: dict[int, float]) -> None:
    from atlas_tracking.adapters import find_routed_layers

    for lay in find_routed_layers(model):
        for e, b in bias.items():
            lay.router.e_score_correction_bias[e] = b


def test_tokens_routed_to_zero_experts_only_form_no_pair_distance_or_content_drift():
    model = family_model("longcat_flash")
    _biased(model, {8: 10.0, 9: 10.0})  # every token selects both identity slots
    report = measure(model, CANARY, config=CFG)
    again = measure(model, CANARY, baseline=Baseline.from_report(report), config=CFG)
    data = again.to_dict()
    assert verify(report.to_dict()) == [] and verify(data) == []
    n_tokens = CANARY.n_windows * CANARY.window
    for layer, pw in zip(data["layers"], data["per_window"]["layers"]):
        r = layer["receipts"]
        assert r["c2"] is None and r["v2_c1"] is None and r["v2_c2"] is None and r["transition_incompat"] is None
        assert sum(pw["d_adjacent_boundary"]["count"]) == sum(pw["d_adjacent_interior"]["count"]) == 0
        candidates = n_tokens - r["excluded_tokens"]  # every counted token's swap pair, plus the random pairs
        assert r["zero_expert_pairs"] >= candidates
        assert sum(pw["drift"]["content_drift"]["count"]) == 0 < sum(pw["drift"]["coord_drift"]["count"])


def test_one_identity_slot_leaves_the_swap_pair_but_no_co_active_pair():
    model = family_model("longcat_flash")
    _biased(model, {8: 10.0})  # every token selects identity slot 8 and one real expert
    data = measure(model, CANARY, config=CFG).to_dict()
    assert verify(data) == []
    for layer in data["layers"]:
        r = layer["receipts"]
        assert r["c2"] is None  # one field-carrying active expert: no pair
        assert r["v2_c1"] is not None and r["transition_incompat"] is not None  # e_k and e_k1 are real experts
        assert 0 <= r["d_adjacent_boundary"] <= 1 and 0 <= r["d_random_boundary"] <= 1
