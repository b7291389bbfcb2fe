"""Training-batch load between gates: per routed layer, how evenly the routes the model's router chose over a
logging interval fall on its experts, and the bounded summary of an interval over every layer
(docs/telemetry.md#what-the-numbers-mean).

A layer's ``load[e]`` is the number of routes to expert ``e`` in the interval (``sum_e load[e] = k`` times the
tokens the router saw). From it: the population CV of the loads, the largest load over the mean (the share of
the busiest expert over the uniform share ``1/E``), the dead experts (no route in the whole interval) and the
entropy of the shares normalised by ``ln E`` (1: uniform; 0: one expert takes every route).

Example:
    >>> s = layer_stats([6, 2, 0, 0])
    >>> round(s.cv, 4), s.max_over_mean, s.dead, round(s.entropy, 4)
    (1.2247, 3.0, [2, 3], 0.4056)
    >>> ranked_experts([6, 2, 0, 1], 2)
    ([(0, 0.6667), (1, 0.2222)], [(2, 0.0), (3, 0.1111)])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def load_cv(load: Sequence[float] | np.ndarray) -> float:
    """Population standard deviation of the loads over their mean (0 when no route was counted)."""
    arr = np.asarray(load, dtype=np.float64)
    mean = arr.mean() if arr.size else 0.0
    return float(arr.std() / mean) if mean > 0 else 0.0


def max_over_mean(values: Sequence[float] | np.ndarray) -> float:
    """The largest value over the mean (1: even; ``E``: one of ``E`` takes everything; 0 when all are 0)."""
    arr = np.asarray(values, dtype=np.float64)
    mean = arr.mean() if arr.size else 0.0
    return float(arr.max() / mean) if mean > 0 else 0.0


def normalised_entropy(load: Sequence[float] | np.ndarray) -> float:
    """Entropy of the load shares over ``ln E``, in [0, 1] (1 for a single expert, 0 when nothing was routed)."""
    arr = np.asarray(load, dtype=np.float64)
    total = arr.sum()
    if total <= 0:
        return 0.0
    if arr.size < 2:
        return 1.0
    f = arr[arr > 0] / total
    return float(-(f * np.log(f)).sum() / math.log(arr.size)) + 0.0  # one expert alone: 0.0, not -0.0


@dataclass(frozen=True)
class LoadStats:
    """The load statistics of one routed layer over one interval."""

    cv: float
    """Population CV of the loads."""
    max_over_mean: float
    """The busiest expert's load over the mean load."""
    dead: list[int]
    """Experts with no route in the interval."""
    entropy: float
    """Entropy of the load shares over ln E."""
    routes: int
    """Routes counted (the sum of the loads)."""
    experts: int
    """Experts of the layer (E)."""

    @property
    def dead_fraction(self) -> float:
        """The share of the layer's experts with no route."""
        return len(self.dead) / self.experts if self.experts else 0.0


def layer_stats(load: Sequence[int] | np.ndarray) -> LoadStats:
    """:class:`LoadStats` of one layer's per-expert loads."""
    arr = np.asarray(load, dtype=np.float64)
    return LoadStats(cv=load_cv(arr), max_over_mean=max_over_mean(arr),
                     dead=[int(e) for e in np.flatnonzero(arr == 0)], entropy=normalised_entropy(arr),
                     routes=int(arr.sum()), experts=int(arr.size))


def ranked_experts(load: Sequence[int] | np.ndarray, count: int) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """The ``count`` experts with the largest and with the smallest shares of the layer's routes, as ``(expert,
    share)`` rounded to 4 digits; ties go to the lower expert id."""
    arr = np.asarray(load, dtype=np.float64)
    total = arr.sum()
    shares = arr / total if total > 0 else np.zeros_like(arr)
    top = sorted(range(arr.size), key=lambda e: (-shares[e], e))[:count]
    bottom = sorted(range(arr.size), key=lambda e: (shares[e], e))[:count]
    return ([(e, round(float(shares[e]), 4)) for e in top], [(e, round(float(shares[e]), 4)) for e in bottom])
