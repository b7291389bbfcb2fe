"""Conventions an independent reimplementation checks: the usual median, and boundary tokens without a random
competitor counted rather than silently dropped."""

from __future__ import annotations

import json

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
