"""Window bootstrap: pooled ratios, percentile CIs and paired differences (docs/receipts.md#statistics).

Windows, not tokens, are resampled. Every mean receipt is a ratio of per-window sums to
per-window counts, so a resample is a weighted re-count of whole windows.

Example:
    >>> import numpy as np
    >>> idx = bootstrap_indices(4, n_resamples=200, seed=0)
    >>> sums, counts = np.array([1.0, 2.0, 3.0, 4.0]), np.ones(4)
    >>> est = ratio(sums, counts)
    >>> lo, hi = ratio_ci(sums, counts, idx, level=0.95)
    >>> est, lo <= est <= hi
    (2.5, True)
"""

from __future__ import annotations

import math

import numpy as np


def bootstrap_indices(n_windows: int, n_resamples: int, seed: int) -> np.ndarray:
    """``[n_resamples, n_windows]`` window indices drawn with replacement (fixed seed)."""
    if n_windows < 1:
        raise ValueError("bootstrap needs at least one window")
    rng = np.random.default_rng(seed)
    return rng.integers(0, n_windows, size=(n_resamples, n_windows))


def multiplicity(idx: np.ndarray, n_windows: int) -> np.ndarray:
    """``[n_resamples, n_windows]``: how many times each window was drawn in each resample."""
    offsets = idx + (np.arange(idx.shape[0]) * n_windows)[:, None]
    return np.bincount(offsets.ravel(), minlength=idx.shape[0] * n_windows).reshape(idx.shape[0], n_windows)


def ratio(sums: np.ndarray, counts: np.ndarray) -> float:
    """Pooled mean ``sum(sums) / sum(counts)``; NaN when nothing was counted."""
    return float(pooled_ratios(sums, counts))


def pooled_ratios(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """:func:`ratio` along the last axis (``sums`` and ``counts`` ``[R, W]`` give ``[R]``).

    >>> pooled_ratios(np.array([[1.0, 2.0], [0.0, 0.0]]), np.array([[1, 2], [0, 0]])).tolist()
    [1.0, nan]
    """
    return _divide(np.asarray(sums, np.float64).sum(axis=-1), np.asarray(counts, np.float64).sum(axis=-1))


def _divide(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``sums / counts``, NaN where nothing was counted."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.where(counts > 0, counts, 1.0), np.nan)


def percentile_ci(samples: np.ndarray, level: float) -> tuple[float, float]:
    samples = samples[np.isfinite(samples)]
    if samples.size == 0:
        return math.nan, math.nan
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(samples, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


_LAST_MULTIPLICITY: list[tuple[np.ndarray, np.ndarray]] = []
"""The last ``(idx, float multiplicity)`` pair: a gate resamples dozens of receipts on the same indices."""


def float_multiplicity(idx: np.ndarray, n_windows: int) -> np.ndarray:
    """:func:`multiplicity` as float64, reused while the same ``idx`` array is passed again."""
    if _LAST_MULTIPLICITY and _LAST_MULTIPLICITY[0][0] is idx and _LAST_MULTIPLICITY[0][1].shape[1] == n_windows:
        return _LAST_MULTIPLICITY[0][1]
    mult = multiplicity(idx, n_windows).astype(np.float64)
    _LAST_MULTIPLICITY[:] = [(idx, mult)]  # holds idx, so its id cannot be reused while cached
    return mult


def ratio_samples(sums: np.ndarray, counts: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Bootstrap replicates of the pooled ratio (a resample re-counts whole windows by multiplicity)."""
    return ratio_sample_matrix(np.asarray(sums)[None], np.asarray(counts)[None], idx)[:, 0]


def ratio_ci(sums: np.ndarray, counts: np.ndarray, idx: np.ndarray, level: float) -> tuple[float, float]:
    """Percentile CI of the pooled ratio over window resamples."""
    return percentile_ci(ratio_samples(sums, counts, idx), level)


def ratio_cis(sums: np.ndarray, counts: np.ndarray, idx: np.ndarray, level: float) -> np.ndarray:
    """:func:`ratio_ci` of several pooled ratios at once (``sums`` and ``counts`` ``[R, W]``): ``[R, 2]``.

    >>> idx = bootstrap_indices(4, n_resamples=200, seed=0)
    >>> sums, counts = np.array([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]]), np.ones((2, 4))
    >>> together = ratio_cis(sums, counts, idx, 0.95)
    >>> np.allclose(together[0], ratio_ci(sums[0], counts[0], idx, 0.95)), together[1].tolist()
    (True, [0.0, 0.0])
    """
    return percentile_cis(ratio_sample_matrix(sums, counts, idx), level)


def ratio_sample_matrix(sums: np.ndarray, counts: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """:func:`ratio_samples` of several pooled ratios (``sums`` and ``counts`` ``[R, W]``): ``[resamples, R]``."""
    sums, counts = np.asarray(sums, np.float64), np.asarray(counts, np.float64)
    mult = float_multiplicity(idx, sums.shape[1])
    return _divide(mult @ sums.T, mult @ counts.T)  # NaN where a resample counted nothing


def percentile_cis(samples: np.ndarray, level: float) -> np.ndarray:
    """:func:`percentile_ci` of every column of ``samples`` ``[resamples, R]``: ``[R, 2]``, with one quantile call
    for the columns that every resample defines."""
    alpha = (1.0 - level) / 2.0
    out = np.full((samples.shape[1], 2), np.nan)
    whole = np.isfinite(samples).all(axis=0)
    if whole.any():
        out[whole] = np.quantile(samples[:, whole], [alpha, 1.0 - alpha], axis=0).T
    for r in np.flatnonzero(~whole):
        out[r] = percentile_ci(samples[:, r], level)
    return out


def diff_ci(
    sums_a: np.ndarray, counts_a: np.ndarray, sums_b: np.ndarray, counts_b: np.ndarray, idx: np.ndarray, level: float
) -> tuple[float, float]:
    """CI of ``ratio_a - ratio_b`` with both ratios resampled on the same windows (paired)."""
    return percentile_ci(ratio_samples(sums_a, counts_a, idx) - ratio_samples(sums_b, counts_b, idx), level)
