"""Lifecycle margins: handoff and refinement (docs/receipts.md#lifecycle-margins; the report's eq. 31-32).

Exact margins on per-layer receipts. Positive is inside the boundary. A layer compared with itself has a
handoff term of exactly 0 and a refinement term of exactly 0, whatever its dead experts.

Example:
    >>> now = [{"c2": 0.10, "pi_min": 0.02}, {"c2": 0.05, "pi_min": 0.01}]
    >>> ref = [{"c2": 0.08, "pi_min": 0.02}, {"c2": 0.05, "pi_min": 0.02}]
    >>> round(handoff_margin(now, ref, [0, 1], lam1=1.0, lam2=0.1, n_tokens=1000)[0], 6)
    -0.047619
    >>> drift = [{"boundary_drift": 0.0, "content_drift": 0.0}] * 2
    >>> refine_margin(ref, drift, ref, [0, 1], mu=(1.0, 1.0, 0.1), tau=0.25, n_tokens=1000)[0]
    0.25
    >>> dead = [{"c2": 0.1, "pi_min": 0.0}]
    >>> handoff_margin(dead, dead, [0], lam1=1.0, lam2=0.1, n_tokens=1000)[0], refine_margin(
    ...     dead, drift, dead, [0], mu=(1.0, 1.0, 0.1), tau=0.25, n_tokens=1000)[0]
    (0.0, 0.25)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def occupancy_ratio(pi: Any, pi_ref: Any, n_tokens: int) -> Any:
    """``rho = (pi_min + 1/T) / (pi_min_ref + 1/T)``: the ratio ``pi_min / pi_min_ref`` with one token of
    smoothing on both sides, so equal occupancy gives exactly 1, dead experts on both sides included.

    Works on numbers and on tensors alike (the smooth margins use it too).

    >>> occupancy_ratio(0.0, 0.0, 1000), occupancy_ratio(0.02, 0.02, 1000), round(occupancy_ratio(0.0, 0.009, 1000), 6)
    (1.0, 1.0, 0.1)
    """
    eps = 1.0 / n_tokens
    return (pi + eps) / (pi_ref + eps)


def handoff_terms(now: Sequence[dict], ref: Sequence[dict], lam1: float, lam2: float, n_tokens: int) -> list[float]:
    """Per-layer ``lam1 (c2 - c2_ref) + lam2 (rho - 1)`` with ``rho`` the :func:`occupancy_ratio` (eq. 31).

    A layer without C2 on either side (top-1 routing has no co-active pairs) has no C2 term: its term is the
    occupancy term alone, never a C2 change of 0 (docs/receipts.md#lifecycle-margins).

    >>> top1 = [{"c2": None, "pi_min": 0.01}]
    >>> round(handoff_terms(top1, [{"c2": None, "pi_min": 0.02}], lam1=1.0, lam2=0.1, n_tokens=1000)[0], 6)
    -0.047619
    """
    return [
        (0.0 if a["c2"] is None or b["c2"] is None else lam1 * (a["c2"] - b["c2"]))
        + lam2 * (occupancy_ratio(a["pi_min"], b["pi_min"], n_tokens) - 1.0)
        for a, b in zip(now, ref)
    ]


def handoff_margin(
    now: Sequence[dict], ref: Sequence[dict], protected: Sequence[int], lam1: float, lam2: float, n_tokens: int
) -> tuple[float, int]:
    """Exact handoff margin (min over protected layers) and the ordinal of the binding layer."""
    terms = handoff_terms(now, ref, lam1, lam2, n_tokens)
    worst = min(protected, key=lambda i: terms[i])
    return terms[worst], worst


def refine_terms(
    now: Sequence[dict], drift: Sequence[dict], base: Sequence[dict], mu: tuple[float, float, float], n_tokens: int
) -> list[float]:
    """Per-layer repurposing load ``mu1 bd + mu2 cd + mu3 (1 - rho)`` against the base, with ``rho`` the
    :func:`occupancy_ratio` (eq. 32)."""
    mu1, mu2, mu3 = mu
    return [
        mu1 * d["boundary_drift"] + mu2 * d["content_drift"] + mu3 * (1.0 - occupancy_ratio(a["pi_min"], b["pi_min"], n_tokens))
        for a, d, b in zip(now, drift, base)
    ]


def refine_margin(
    now: Sequence[dict],
    drift: Sequence[dict],
    base: Sequence[dict],
    protected: Sequence[int],
    mu: tuple[float, float, float],
    tau: float,
    n_tokens: int,
) -> tuple[float, int]:
    """Exact refinement margin ``tau - max`` over protected layers, and the binding layer."""
    terms = refine_terms(now, drift, base, mu, n_tokens)
    worst = max(protected, key=lambda i: terms[i])
    return tau - terms[worst], worst


def protected_ordinals(n_layers: int, protected: str | list[int]) -> list[int]:
    """Routed-layer ordinals to protect: 'mid' = the middle half, 'all', or an explicit list.

    'auto' is chosen from a run's history (:mod:`atlas_tracking.decisions.protection`); without one (a gate
    measured outside a run) it is 'mid'.

    >>> protected_ordinals(8, "mid"), protected_ordinals(3, "mid"), protected_ordinals(3, [0, 2])
    ([2, 3, 4, 5], [0, 1], [0, 2])
    """
    if protected == "all":
        return list(range(n_layers))
    if protected in ("mid", "auto"):
        start = n_layers // 4
        return list(range(start, start + max(1, math.ceil(n_layers / 2))))
    bad = [i for i in protected if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"protected layer ordinals {bad} are outside the {n_layers} routed layers")
    return sorted(set(protected))
