"""Paired gate-vs-baseline comparisons on the same canary windows (docs/receipts.md#statistics).

Both gates saw the same windows, so a bootstrap resample draws the same windows for both and
the CI is that of the paired difference.

Example:
    >>> import numpy as np
    >>> from atlas_tracking.receipts.stats import bootstrap_indices
    >>> idx = bootstrap_indices(3, 100, 0)
    >>> loads0 = np.array([[2, 0], [2, 0], [1, 1]])
    >>> out = occupancy_samples(loads0, loads0, idx)
    >>> float(out["now"]["dead_experts"][0]), bool((out["now"]["load_cv"] == out["base"]["load_cv"]).all())
    (0.0, True)
"""

from __future__ import annotations

import numpy as np

from atlas_tracking.receipts.stats import float_multiplicity


def _occupancy_stats(loads: np.ndarray) -> dict[str, np.ndarray]:
    """Dead experts, router entropy and load CV of each row of ``loads [R, E]``."""
    loads = loads.astype(np.float64, copy=False)
    total = loads.sum(axis=1, keepdims=True)
    f = np.divide(loads, total, out=np.zeros_like(loads), where=total > 0)
    ent = -(f * np.log(f, out=np.zeros_like(f), where=f > 0)).sum(axis=1)  # 0 log 0 = 0
    mean = loads.mean(axis=1)
    cv = np.divide(loads.std(axis=1), mean, out=np.zeros_like(mean), where=mean > 0)
    return {"dead_experts": (loads == 0).sum(axis=1).astype(np.float64), "router_entropy": ent, "load_cv": cv}


def occupancy_samples(loads_now: np.ndarray, loads_base: np.ndarray, idx: np.ndarray) -> dict[str, np.ndarray]:
    """Occupancy statistics of both gates: the full canary (index 0) then every window resample.

    ``loads_*`` are per-window expert loads ``[W, E]``; ``idx`` are bootstrap window indices.
    Returns ``{"now": {stat: [1 + R]}, "base": {...}}``.
    """
    mult = float_multiplicity(idx, loads_now.shape[0])
    mult = np.vstack([np.ones((1, loads_now.shape[0])), mult])
    return {"now": _occupancy_stats(mult @ loads_now), "base": _occupancy_stats(mult @ loads_base)}
