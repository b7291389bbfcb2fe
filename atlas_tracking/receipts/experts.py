"""Per-expert load of a routed layer: each expert's share of the layer's routes, its change since the baseline,
and which experts are dead or overloaded (docs/receipts.md#per-expert-load).

Example:
    >>> loads = total_loads([[3, 0, 1, 0], [5, 0, 3, 0]])
    >>> loads, expert_shares(loads).tolist()
    ([8, 0, 4, 0], [0.6666666666666666, 0.0, 0.3333333333333333, 0.0])
    >>> dead_experts(loads), overloaded_experts(loads)
    ([1, 3], [0])
    >>> bounded_list([3, 7, 12, 20, 21, 22, 23, 40])
    '3, 7, 12 (+5 more)'
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

OVERLOAD_FACTOR = 2.0
"""An expert is overloaded when its share of the layer's routes exceeds this multiple of the uniform share 1/E."""
LIST_LIMIT = 3
"""Experts an alert names per layer and kind before it counts the rest."""


def total_loads(window_loads: Sequence[Sequence[float]] | np.ndarray) -> list[int]:
    """Routes each expert received over the canary: the ``[windows, E]`` per-window loads summed over windows."""
    return [round(float(x)) for x in np.asarray(window_loads, dtype=np.float64).sum(axis=0)]


def expert_shares(loads: Sequence[float] | np.ndarray) -> np.ndarray:
    """Each expert's share of the layer's routes (zeros when the layer received none)."""
    arr = np.asarray(loads, dtype=np.float64)
    total = arr.sum()
    return arr / total if total > 0 else np.zeros_like(arr)


def share_change(loads: Sequence[float], baseline_loads: Sequence[float]) -> np.ndarray:
    """Each expert's share now minus its share at the baseline.

    >>> share_change([1, 3], [2, 2]).tolist()
    [-0.25, 0.25]
    """
    return expert_shares(loads) - expert_shares(baseline_loads)


def dead_experts(loads: Sequence[float]) -> list[int]:
    """The experts no canary token selected."""
    return [int(e) for e in np.flatnonzero(np.asarray(loads, dtype=np.float64) == 0)]


def overloaded_experts(loads: Sequence[float], factor: float = OVERLOAD_FACTOR) -> list[int]:
    """The experts whose share exceeds ``factor`` times the uniform share ``1/E``."""
    shares = expert_shares(loads)
    return [int(e) for e in np.flatnonzero(shares > factor / max(len(shares), 1))]


def bounded_list(ids: Sequence[int], limit: int = LIST_LIMIT) -> str:
    """The first ``limit`` ids and a count of the rest.

    >>> bounded_list([4]), bounded_list([1, 2, 3])
    ('4', '1, 2, 3')
    """
    head = ", ".join(str(i) for i in ids[:limit])
    return head + (f" (+{len(ids) - limit} more)" if len(ids) > limit else "")
