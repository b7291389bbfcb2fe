"""The rollout-agreement receipts against plain numpy loops over the same scores and routes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from atlas_tracking.receipts.rollout import (
    PRECISIONS,
    compare_tokens,
    first_mismatch,
    layer_agreement,
    logprob_agreement,
)
from atlas_tracking.receipts.state1 import NEAR_TIE_DTYPES

EPS = {name: torch.finfo(dtype).eps for name, dtype in NEAR_TIE_DTYPES.items()}
"""The rounding of each precision a near tie is read at (docs/receipts.md#near-tie-mass)."""


def reference(scores: np.ndarray, trainer: np.ndarray, rollout: np.ndarray, mask: np.ndarray) -> dict:
    """One layer's agreement, token by token."""
    n, k = trainer.shape
    out = {"tokens": 0, "compared": 0, "fallback": 0, "mismatched": 0, "routes_moved": 0}
    jaccard, margins, gaps, ties = [], [], [], []
    for t in range(n):
        if not mask[t]:
            continue
        out["tokens"] += 1
        r = [int(e) for e in rollout[t]]
        if min(r) < 0 or len(set(r)) != k:
            out["fallback"] += 1
            continue
        out["compared"] += 1
        a, b = {int(e) for e in trainer[t]}, set(r)
        both = len(a & b)
        out["mismatched"] += a != b
        out["routes_moved"] += k - both
        jaccard.append(both / len(a | b))
        s_k = min(scores[t, e] for e in a)
        rest = [scores[t, e] for e in range(scores.shape[1]) if e not in a and np.isfinite(scores[t, e])]
        if not rest:
            continue
        s_k1 = max(rest)
        scale = abs(s_k) + abs(s_k1)
        margins.append((s_k - s_k1) / scale if scale else 0.0)
        ties.append({p: abs(s_k - s_k1) <= eps * scale for p, eps in EPS.items()})
        if a != b:
            gap = (max(scores[t, e] for e in range(scores.shape[1]) if e not in b) - min(scores[t, e] for e in b)) / scale
            if math.isfinite(gap):
                gaps.append(gap)
    out["mismatch"] = out["mismatched"] / out["compared"]
    out["jaccard"] = float(np.mean(jaccard))
    out["near_tie"] = {p: sum(tie[p] for tie in ties) / len(ties) for p in EPS}
    median = float(np.median(gaps))
    out["perturbation"] = {"median": median, "p90": float(np.quantile(gaps, 0.9)), "max": max(gaps)}
    out["boundary_mass"] = sum(m <= median for m in margins) / len(margins)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layer_agreement_equals_the_loop(seed):
    rng = np.random.default_rng(seed)
    n, e, k = 400, 8, 2
    scores = rng.normal(size=(n, e)).astype(np.float32)
    scores[:40, 3] = scores[:40, 5]                       # exact ties
    scores[40:60] = np.round(scores[40:60], 1)            # more ties, rounded
    scores[60:80, 7] = -np.inf                            # an ineligible expert
    scores[80:90, 2:] = -np.inf                           # no eligible competitor past the top-2
    trainer = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    rollout = trainer.copy()
    flip = rng.random(n) < 0.3                            # the rollout takes another expert at some positions
    rollout[flip, 1] = (trainer[flip, 1] + rng.integers(1, e, flip.sum())) % e
    same = rollout[:, 0] == rollout[:, 1]
    rollout[same, 1] = (rollout[same, 1] + 1) % e
    rollout[100:105] = -1                                 # positions without a route
    rollout[105:108, 1] = rollout[105:108, 0]             # a repeated expert: not a set
    mask = rng.random(n) < 0.9
    t = compare_tokens(torch.from_numpy(scores), torch.from_numpy(trainer), torch.from_numpy(rollout))
    got = layer_agreement(*t.host(), mask=mask, k=k)
    want = reference(scores, trainer, rollout, mask)
    for key in ("tokens", "compared", "fallback", "mismatched", "routes_moved"):
        assert got[key] == want[key], key
    assert got["routes"] == k * want["compared"]
    assert got["mismatch"] == pytest.approx(want["mismatch"], abs=1e-6)
    assert got["jaccard"] == pytest.approx(want["jaccard"], abs=1e-6)
    for p in PRECISIONS:
        assert got["near_tie"][p] == pytest.approx(want["near_tie"][p], abs=1e-6)
    for q in ("median", "p90", "max"):
        assert got["perturbation"][q] == pytest.approx(want["perturbation"][q], rel=1e-5)
    assert got["boundary_mass"] == pytest.approx(want["boundary_mass"], abs=1e-6)
    assert got["near_tie"]["bf16"] > 0 and got["fallback"] > 0 and got["mismatched"] > 0


def test_an_exact_tie_is_a_near_tie_at_every_precision_and_a_set_that_agrees_has_no_gap():
    scores = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    t = compare_tokens(scores, torch.tensor([[0, 1]]), torch.tensor([[0, 2]]))
    row = layer_agreement(*t.host(), mask=np.ones(1, bool), k=2)
    assert t.margin_rel.item() == 0.0 and t.gap_rel.item() == 0.0   # the rollout took the other side of a tie
    assert row["near_tie"] == {"bf16": 1.0, "fp16": 1.0} and row["mismatched"] == 1
    agree = compare_tokens(scores, torch.tensor([[0, 1]]), torch.tensor([[1, 0]]))
    assert agree.overlap.item() == 2 and agree.gap_rel.item() == -agree.margin_rel.item()   # at most 0


def test_a_rollout_expert_the_trainer_cannot_select_has_an_infinite_gap_left_out_of_the_perturbation():
    scores = torch.tensor([[2.0, 1.0, 0.5, float("-inf")]])
    t = compare_tokens(scores, torch.tensor([[0, 1]]), torch.tensor([[0, 3]]))
    row = layer_agreement(*t.host(), mask=np.ones(1, bool), k=2)
    assert math.isinf(t.gap_rel.item()) and row["mismatched"] == 1
    assert row["perturbation"] is None and row["boundary_mass"] is None


def test_first_mismatch_reads_layers_in_forward_order_and_skips_positions_not_compared():
    mismatch = np.array([[1, 0, 0, 1], [1, 1, 0, 0]], bool)
    compared = np.array([[0, 1, 1, 1], [1, 1, 1, 1]], bool)    # position 0's first layer fell back
    got = first_mismatch(mismatch, compared, np.array([1, 1, 1, 0], bool), [4, 7])
    assert got == {"tokens": 3, "by_layer": {"4": 0, "7": 2}, "none": 1}


def test_logprob_agreement_is_the_mean_abs_difference_and_k3():
    rng = np.random.default_rng(0)
    a, b = -rng.random(50) * 3, -rng.random(50) * 3
    a[:5] = np.nan                                            # prompt positions without a rollout log-prob
    mask = np.ones(50, bool)
    mask[-3:] = False
    got = logprob_agreement(a, b, mask)
    keep = [i for i in range(50) if mask[i] and np.isfinite(a[i])]
    k3 = sum(math.exp(b[i] - a[i]) - 1 - (b[i] - a[i]) for i in keep) / len(keep)
    assert got["tokens"] == len(keep) == 42
    assert got["abs_diff_mean"] == pytest.approx(sum(abs(b[i] - a[i]) for i in keep) / len(keep), abs=1e-6)
    assert got["k3"] == pytest.approx(k3, abs=1e-6) and got["k3"] >= 0


def test_a_margin_exactly_at_a_precisions_rounding_is_a_near_tie_there_and_not_at_a_finer_one():
    eps = EPS["bf16"]
    scores = torch.tensor([[3.0, 1 + eps, 1 - eps, 0.0]])           # margin / (|s_k| + |s_k1|) = eps exactly
    t = compare_tokens(scores, torch.tensor([[0, 1]]), torch.tensor([[0, 1]]))
    row = layer_agreement(*t.host(), mask=np.ones(1, bool), k=2)
    assert t.margin_rel.item() == eps
    assert row["near_tie"] == {"bf16": 1.0, "fp16": 0.0}
