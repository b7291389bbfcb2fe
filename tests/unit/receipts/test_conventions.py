"""Conventions an independent reimplementation checks: the usual median, boundary tokens without a random
competitor counted rather than silently dropped, and lifecycle margins exactly at rest for a layer against itself."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import atlas_tracking.testing.parallel_models as pm
from atlas_tracking import measure
from atlas_tracking.receipts.state1 import boundary_count


@pytest.fixture(scope="module")
def reports():
    """Qwen3-MoE top-2 with 3 experts (a boundary token's only eligible outsider is e_k1) and with 8."""
    c = pm.canary(6)
    return {e: json.loads(measure(pm.qwen3_moe(experts=e), c, config=pm.CFG).to_json()) for e in (3, 8)}


def test_boundary_tokens_without_a_random_competitor_are_counted(reports):
    n_windows, window = reports[3]["canary"]["n_windows"], reports[3]["canary"]["window"]
    for layer in reports[3]["layers"]:
        r = layer["receipts"]
        assert r["excluded_tokens"] == 0  # every token has an adjacent competitor
        assert r["no_random_competitor"] == n_windows * boundary_count(window, 0.1)  # every boundary token
        assert r["v2_c2"] is None and r["d_random_boundary"] is None and r["v2_c1"] is not None
    for layer in reports[8]["layers"]:
        assert layer["receipts"]["no_random_competitor"] == 0 and layer["receipts"]["v2_c2"] is not None


def test_transition_incompat_is_the_usual_median_of_the_boundary_jumps(reports):
    for report in reports.values():
        for layer, pw in zip(report["layers"], report["per_window"]["layers"]):
            jumps = np.concatenate([np.asarray(w, dtype=np.float64) for w in pw["transition_jump"]])
            assert jumps.size % 2 == 0  # an even boundary set: the two middle values are averaged
            assert layer["receipts"]["transition_incompat"] == pytest.approx(float(np.median(jumps)), abs=1e-12)
            assert layer["receipts"]["transition_incompat"] != pytest.approx(float(np.sort(jumps)[jumps.size // 2 - 1]))


@pytest.mark.parametrize("pi_min", [0.0, 1e-4, 0.03])
def test_a_layer_compared_with_itself_has_margins_exactly_at_rest(pi_min):
    """The occupancy ratio (pi_min + 1/T) / (pi_min_ref + 1/T) is exactly 1 at equal occupancy, dead experts (pi_min
    = 0) included: the handoff term is exactly 0 and the refinement margin exactly tau, on the exact and the smooth
    margins alike (docs/receipts.md#occupancy-ratio)."""
    import torch

    from atlas_tracking.receipts.lifecycle import handoff_margin, occupancy_ratio, refine_margin
    from atlas_tracking.receipts.smooth import smooth_handoff_margin, smooth_refine_margin

    layer = [{"c2": 0.07, "pi_min": pi_min}] * 3
    still = [{"boundary_drift": 0.0, "content_drift": 0.0}] * 3
    assert handoff_margin(layer, layer, [0, 1, 2], lam1=1.0, lam2=0.1, n_tokens=4096) == (0.0, 0)
    assert refine_margin(layer, still, layer, [0, 1, 2], mu=(1.0, 1.0, 0.1), tau=0.25, n_tokens=4096)[0] == 0.25
    pi = torch.full((3,), pi_min, dtype=torch.float64)
    c2 = torch.full((3,), 0.07, dtype=torch.float64)
    zero = torch.zeros(3, dtype=torch.float64)
    assert float(smooth_handoff_margin(c2, c2, pi, pi, lam1=1.0, lam2=0.1, beta_h=50.0, n_tokens=4096)) == \
        pytest.approx(-math.log(3) / 50.0)  # smin over three equal zeros: -ln(3)/beta, exactly 0 as beta grows
    assert float(smooth_refine_margin(zero, zero, pi, pi, mu=(1.0, 1.0, 0.1), tau=0.25, beta_r=50.0, n_tokens=4096)) == \
        pytest.approx(0.25 - math.log(3) / 50.0)
    # against a plain reference of the ratio
    for a, b in [(0.0, 0.01), (0.02, 0.0), (0.005, 0.005)]:
        assert occupancy_ratio(a, b, 1000) == pytest.approx((a * 1000 + 1) / (b * 1000 + 1), rel=1e-12)
