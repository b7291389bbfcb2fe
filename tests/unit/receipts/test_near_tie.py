"""Near-tie mass (docs/receipts.md#near-tie-mass): the per-token mask against a plain-numpy loop, closed forms at the
bound, and the layer shares and cross-layer summaries built from its counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atlas_tracking.receipts import state1, windows
from atlas_tracking.receipts.stats import bootstrap_indices
from atlas_tracking.testing.numpy_reference import near_tie_loop

DTYPES = list(state1.NEAR_TIE_DTYPES.values())
EPS = [torch.finfo(p).eps for p in DTYPES]
INF = float("inf")


def _mask(scores, active) -> np.ndarray:
    sm = state1.set_margin(torch.tensor(scores, dtype=torch.float32), torch.tensor(active))
    return state1.near_ties(sm, DTYPES).T.numpy()


def test_the_precisions_and_their_roundings():
    assert {"bf16": torch.bfloat16, "fp16": torch.float16} == state1.NEAR_TIE_DTYPES
    assert EPS == [2.0 ** -7, 2.0 ** -10]


@pytest.mark.parametrize("seed", range(4))
def test_the_mask_equals_the_numpy_loop(seed):
    """Scores of every size and sign, with close pairs, exact ties, zeros, ineligible experts and tokens whose active
    set is not a top-k (negative margins), against the loop, token by token."""
    rng = np.random.default_rng(seed)
    n, e, k = 400, 8, 2
    scale = 10.0 ** rng.uniform(-3, 3, size=(n, 1))
    scores = (rng.normal(size=(n, e)) * scale).astype(np.float32)
    close = rng.random(n) < 0.5  # the best unselected expert within a few bf16 roundings of the k-th
    order = np.argsort(-scores, axis=1)
    rows = np.flatnonzero(close)
    s_k = scores[rows, order[rows, k - 1]]
    scores[rows, order[rows, k]] = s_k - rng.uniform(-1, 4, size=len(rows)).astype(np.float32) * 2 ** -7 * np.abs(s_k)
    scores[rng.random(n) < 0.05] = 0.0  # exact ties at zero
    scores[rng.random((n, e)) < 0.2] = -np.inf
    scores[:10, 2:] = -np.inf  # exactly k eligible: no competitor
    active = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    swap = rng.random(n) < 0.1  # the model picked the (k+1)-th: a negative margin
    active[swap, k - 1] = np.argsort(-scores[swap], axis=1, kind="stable")[:, k]
    got = _mask(scores, active)
    ref = near_tie_loop(scores, active, EPS)
    for t, r in enumerate(ref):
        assert got[t].tolist() == (r or [False, False]), (t, scores[t], active[t])
    hits = np.array([r for r in ref if r is not None])
    assert 0 < hits[:, 1].sum() < hits[:, 0].sum() < len(hits)  # every case is exercised, fp16's rounding the finer
    assert sum(r is None for r in ref) >= 10


@pytest.mark.parametrize("i", range(2))
def test_a_margin_exactly_at_the_bound_is_a_near_tie_and_one_ulp_beyond_is_not(i):
    """``s_k = 1 + eps``, ``s_k1 = 1 - eps``: ``m = 2 eps = eps (|s_k| + |s_k1|)`` exactly, in float32; and the same
    pair chosen the other way round (``m = -2 eps``: within the rounding, so a near tie and no rank violation)."""
    eps = EPS[i]
    below = float(np.nextafter(np.float32(1 - eps), np.float32(-1)))
    scores = [[1 + eps, 1 - eps, 0.0], [1 + eps, below, 0.0], [1 - eps, 1 + eps, 0.0], [below, 1 + eps, 0.0]]
    active = [[0]] * 4
    assert _mask(scores, active)[:, i].tolist() == [True, False, True, False]
    sm = state1.set_margin(torch.tensor(scores), torch.tensor(active))
    bound = eps * state1.tie_scale(sm)
    assert sm.margin[0] == bound[0] and sm.margin[2] == -bound[2]  # exactly at the bound
    assert (sm.margin < -bound).tolist() == [False, False, False, True]  # the rank violation beyond it


def test_closed_forms():
    scores = [
        [0.0, 0.0, 0.0],  # an exact tie at zero: a near tie at every precision
        [3.0, 3.0, 1.0],  # an exact tie
        [2.0 ** -8, -(2.0 ** -8), 0.0],  # opposite signs: m = 2^-7 = |s_k| + |s_k1|, far above either rounding
        [1.0, -INF, -INF],  # no eligible competitor
        [-INF, 0.5, -INF],  # the active set holds an ineligible expert: an infinite margin
        [1.0, 1.0 - 2.0 ** -9, 0.0],  # within bf16's rounding, not fp16's
    ]
    got = _mask(scores, [[0]] * 6)
    assert got.tolist() == [[True, True], [True, True], [False, False], [False, False], [False, False], [True, False]]
    assert near_tie_loop(np.array(scores), np.array([[0]] * 6), EPS) == [
        [True, True], [True, True], [False, False], None, [False, False], [True, False]]


def test_layer_shares_are_ratios_of_the_counts_and_the_summary_reads_them():
    pw = {"near_tie": {"bf16": {"sum": [2, 1, 0], "count": [16, 15, 16]},
                       "fp16": {"sum": [1, 0, 0], "count": [16, 15, 16]}}}
    values, cis = windows.ratio_receipts(pw["near_tie"], bootstrap_indices(3, 50, 0), 0.95)
    assert values == {"bf16": 3 / 47, "fp16": 1 / 47}
    assert windows.near_tie_tokens(pw["near_tie"]) == {"bf16": 3, "fp16": 1, "counted": 47}
    assert all(lo <= values[name] <= hi for name, (lo, hi) in cis.items())
    layers = [{"num_experts": 8, "receipts": {"near_tie": near}}
              for near in ({"bf16": 0.25, "fp16": 0.0}, {"bf16": 0.05, "fp16": 0.01}, {"bf16": None, "fp16": None})]
    s = windows.summary(layers, None)
    assert (s["near_tie_bf16"], s["near_tie_bf16_max"]) == (pytest.approx(0.15), 0.25)
    assert (s["near_tie_fp16"], s["near_tie_fp16_max"]) == (pytest.approx(0.005), 0.01)
    assert windows.summary(layers[2:], None)["near_tie_bf16_max"] is None  # no counted token in any layer


def test_counts_over_different_tokens_are_malformed():
    with pytest.raises(ValueError, match="count different tokens"):
        windows.near_tie_tokens({"bf16": {"sum": [1], "count": [16]}, "fp16": {"sum": [0], "count": [15]}})
