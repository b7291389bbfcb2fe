"""Rollout agreement: the trainer's routing of the rollout's tokens against the rollout engine's own
(docs/rollout.md#what-is-measured).

Two steps. :func:`compare_tokens` reads one routed layer for N token positions (torch, on the model's device):
whether the rollout's route can be compared at all, the overlap of the trainer's active set with the rollout's,
the trainer's relative set margin and the relative score gap the rollout's choice overcame. :func:`layer_agreement`,
:func:`first_mismatch` and :func:`logprob_agreement` reduce those per-token arrays on the host (numpy).

Example:
    >>> import numpy as np, torch
    >>> scores = torch.tensor([[4.0, 3.0, 2.9, 0.0], [4.0, 3.0, 1.0, 0.0], [4.0, 3.0, 1.0, 0.0]])
    >>> trainer = torch.tensor([[0, 1], [0, 1], [1, 0]])
    >>> rollout = torch.tensor([[0, 2], [1, 0], [-1, -1]])   # a near tie moved; the same set; no route
    >>> t = compare_tokens(scores, trainer, rollout)
    >>> t.usable.tolist(), t.overlap.tolist(), [round(v, 4) for v in t.margin_rel.tolist()]
    ([True, True, False], [1, 2, 0], [0.0169, 0.5, 0.5])
    >>> row = layer_agreement(*(np.asarray(v) for v in t.host()), mask=np.ones(3, bool), k=2)
    >>> row["compared"], row["fallback"], row["mismatched"], row["mismatch"], row["routes_moved"], row["jaccard"]
    (2, 1, 1, 0.5, 1, 0.666667)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from atlas_tracking.receipts.state1 import NEAR_TIE_DTYPES, near_ties, set_margin, tie_scale

PRECISIONS = tuple(NEAR_TIE_DTYPES)
"""The precisions near-tie mass is read at, as a gate reads it (docs/receipts.md#near-tie-mass): bf16 and fp16."""


@dataclass
class TokenComparison:
    """One routed layer's comparison at N token positions (torch, on the scores' device)."""

    usable: torch.Tensor
    """``[N]`` bool: the rollout's route is a set of k distinct expert ids (no ``-1`` sentinel, no repeat)."""
    overlap: torch.Tensor
    """``[N]`` int64: experts in both active sets."""
    margin_rel: torch.Tensor
    """``[N]`` fp32: the trainer's set margin over ``|s_k| + |s_k1|`` (0 for a tie of two zero scores; NaN without
    an eligible competitor)."""
    gap_rel: torch.Tensor
    """``[N]`` fp32: ``(max of s outside the rollout's set - min of s inside it) / (|s_k| + |s_k1|)``: the relative
    score change that makes the rollout's set a top-k of the trainer's scores (at most ``margin_rel`` below zero
    where the sets agree; NaN where not usable or without a competitor; ``inf`` where the rollout chose an
    expert the trainer's router cannot select)."""
    near_tie: torch.Tensor
    """``[P, N]`` bool: per precision of :data:`PRECISIONS`, the trainer's routing is a near tie there, as a gate
    reads it (:func:`~atlas_tracking.receipts.state1.near_ties`)."""

    def host(self) -> tuple[np.ndarray, ...]:
        """The arrays on the host, in field order."""
        return tuple(t.cpu().numpy() for t in (self.usable, self.overlap, self.margin_rel, self.gap_rel, self.near_tie))


def compare_tokens(scores: torch.Tensor, trainer: torch.Tensor, rollout: torch.Tensor) -> TokenComparison:
    """Compare the trainer's active sets ``trainer [N, k]`` (selected by ``scores [N, E]``, fp32, ``-inf`` for an
    ineligible expert) with the rollout's ``rollout [N, k]`` (int64; ``-1`` marks a position without a route)."""
    k = rollout.shape[1]
    same_id = rollout[:, :, None] == rollout[:, None, :]
    usable = (rollout >= 0).all(1) & (same_id.sum((1, 2)) == k)
    overlap = (trainer[:, :, None] == rollout[:, None, :]).any(2).sum(1)
    sm = set_margin(scores, trainer)
    scale = tie_scale(sm)
    nan = torch.full_like(scale, float("nan"))
    margin_rel = torch.where(sm.valid, torch.where(scale > 0, sm.margin / scale, 0.0), nan)
    ids = rollout.clamp(min=0)
    inside = scores.gather(1, ids).min(1).values
    outside = scores.scatter(1, ids, float("-inf")).max(1).values
    gap = (outside - inside) / scale
    gap_rel = torch.where(usable & sm.valid, torch.nan_to_num(gap, nan=float("inf"), posinf=float("inf")), nan)
    return TokenComparison(usable=usable, overlap=overlap, margin_rel=margin_rel, gap_rel=gap_rel,
                           near_tie=near_ties(sm, NEAR_TIE_DTYPES.values()))


def _share(count: float, total: float) -> float | None:
    return round(count / total, 6) if total else None


COUNTS = ("tokens", "compared", "fallback", "mismatched", "routes_moved", "jaccard_sum", "with_margin",
          *(f"near_tie_{name}" for name in PRECISIONS))
"""What :func:`layer_counts` adds up over positions (and processes): ``jaccard_sum`` is a sum of ratios, every
other a count; ``with_margin`` counts the compared positions with an eligible competitor."""


def layer_counts(usable: np.ndarray, overlap: np.ndarray, margin_rel: np.ndarray, near_tie: np.ndarray,
                 mask: np.ndarray, k: int) -> dict[str, float]:
    """One layer's sums over the positions where ``mask`` is true (:data:`COUNTS`): host arrays of
    :class:`TokenComparison`. Sums over several processes' positions add up."""
    mask = mask.astype(bool)
    compared = mask & usable
    both = overlap[compared]
    with_margin = compared & np.isfinite(margin_rel)
    return {
        "tokens": int(mask.sum()), "compared": int(compared.sum()), "fallback": int((mask & ~usable).sum()),
        "mismatched": int((both != k).sum()), "routes_moved": int((k - both).sum()),
        "jaccard_sum": float((both / (2 * k - both)).sum()), "with_margin": int(with_margin.sum()),
        **{f"near_tie_{name}": int((near_tie[i] & with_margin).sum()) for i, name in enumerate(PRECISIONS)},
    }


def mismatch_gaps(usable: np.ndarray, overlap: np.ndarray, gap_rel: np.ndarray, mask: np.ndarray,
                  k: int) -> np.ndarray:
    """The finite relative gaps of the compared positions whose sets differ (a process's share of them)."""
    gaps = gap_rel[mask.astype(bool) & usable & (overlap != k)]
    return gaps[np.isfinite(gaps)]


def within(usable: np.ndarray, margin_rel: np.ndarray, mask: np.ndarray, bound: float) -> int:
    """Compared positions with an eligible competitor whose relative margin is at most ``bound``."""
    margins = margin_rel[mask.astype(bool) & usable & np.isfinite(margin_rel)]
    return int((margins <= bound).sum())


def layer_row(counts: dict[str, float], gaps: np.ndarray, k: int, boundary: int | None) -> dict[str, Any]:
    """One layer's agreement from its :func:`layer_counts`, its :func:`mismatch_gaps` and the count
    :func:`within` the gaps' median (None without gaps), the way :func:`layer_agreement` explains it."""
    n, with_margin = counts["compared"], counts["with_margin"]
    perturbation = None
    if gaps.size:
        perturbation = {"median": float(np.median(gaps)), "p90": float(np.quantile(gaps, 0.9)),
                        "max": float(gaps.max())}
    return {
        "tokens": int(counts["tokens"]), "compared": int(n), "fallback": int(counts["fallback"]),
        "mismatched": int(counts["mismatched"]), "mismatch": _share(counts["mismatched"], n),
        "jaccard": _share(counts["jaccard_sum"], n), "routes": k * int(n), "routes_moved": int(counts["routes_moved"]),
        "near_tie": {name: _share(counts[f"near_tie_{name}"], with_margin) for name in PRECISIONS},
        "perturbation": perturbation,
        "boundary_mass": None if perturbation is None or boundary is None else _share(boundary, with_margin),
    }


def layer_agreement(usable: np.ndarray, overlap: np.ndarray, margin_rel: np.ndarray, gap_rel: np.ndarray,
                    near_tie: np.ndarray, mask: np.ndarray, k: int) -> dict[str, Any]:
    """One layer's agreement over the positions where ``mask`` is true (host arrays of :class:`TokenComparison`).

    ``tokens`` counts the masked positions, ``fallback`` those whose rollout route is not usable (counted, never
    compared), ``compared`` the rest; ``mismatched`` the compared positions whose two active sets differ as sets,
    ``routes_moved`` their routes to an expert the other engine did not choose, ``jaccard`` the mean Jaccard
    index of the two sets. ``near_tie`` is the share of compared positions with an eligible competitor whose
    routing is a near tie at each precision (:data:`PRECISIONS`); ``perturbation`` the median, 90th
    percentile and maximum of the relative score gap the rollout overcame on the mismatched positions (finite
    ones), and ``boundary_mass`` the share of compared positions whose relative margin is within that median."""
    gaps = mismatch_gaps(usable, overlap, gap_rel, mask, k)
    boundary = within(usable, margin_rel, mask, float(np.median(gaps))) if gaps.size else None
    return layer_row(layer_counts(usable, overlap, margin_rel, near_tie, mask, k), gaps, k, boundary)


def first_mismatch(mismatch: np.ndarray, compared: np.ndarray, mask: np.ndarray,
                   layers: list[int]) -> dict[str, Any]:
    """Per token position (where ``mask``), the first routed layer, in forward order, whose two active sets
    differ (``mismatch [L, N]``, read only where ``compared [L, N]``): counts per model layer number, and
    ``none`` for the positions where every compared layer agrees.

    >>> first_mismatch(np.array([[0, 1, 0], [1, 1, 0]], bool), np.ones((2, 3), bool), np.ones(3, bool), [3, 5])
    {'tokens': 3, 'by_layer': {'3': 1, '5': 1}, 'none': 1}
    """
    hit = mismatch.astype(bool) & compared.astype(bool) & mask.astype(bool)[None, :]
    any_hit = hit.any(0)
    first = hit.argmax(0)
    by_layer = {str(layer): int((any_hit & (first == i)).sum()) for i, layer in enumerate(layers)}
    return {"tokens": int(mask.sum()), "by_layer": by_layer, "none": int((mask.astype(bool) & ~any_hit).sum())}


LOGPROB_COUNTS = ("tokens", "abs_sum", "k3_sum")
"""What :func:`logprob_counts` adds up over positions (and processes)."""


def logprob_counts(rollout: np.ndarray, trainer: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """Sums over the positions where ``mask`` and both log-probabilities are finite (:data:`LOGPROB_COUNTS`)."""
    ok = mask.astype(bool) & np.isfinite(rollout) & np.isfinite(trainer)
    r = (trainer - rollout)[ok].astype(np.float64)
    return {"tokens": int(r.size), "abs_sum": float(np.abs(r).sum()), "k3_sum": float(np.sum(np.expm1(r) - r))}


def logprob_row(counts: dict[str, float]) -> dict[str, Any]:
    """The mean absolute difference and k3 from :func:`logprob_counts` (None without a position)."""
    n = counts["tokens"]
    return {"tokens": int(n), "abs_diff_mean": _share(counts["abs_sum"], n), "k3": _share(counts["k3_sum"], n)}


def logprob_agreement(rollout: np.ndarray, trainer: np.ndarray, mask: np.ndarray) -> dict[str, Any]:
    """The two engines' log-probabilities of the same tokens, where ``mask`` and both are finite: the mean
    absolute difference and the k3 estimate of KL(rollout || trainer), ``exp(r) - 1 - r`` with
    ``r = logp_trainer - logp_rollout``, averaged (unbiased for tokens the rollout sampled).

    >>> logprob_agreement(np.array([-1.0, -2.0]), np.array([-1.0, -2.5]), np.ones(2, bool))
    {'tokens': 2, 'abs_diff_mean': 0.25, 'k3': 0.053265}
    """
    return logprob_row(logprob_counts(rollout, trainer, mask))
