"""The terminal cliff of routing self-consistency (docs/receipts.md#terminal-cliff): the depth profile of ``ov_cf`` and its jump.

Over the routed layers in depth order (ordinal 0 .. L-1, ``ov_cf`` each a pooled per-window ratio):

- ``ov_cf_profile``: the per-layer ``ov_cf``, in depth order.
- ``ov_cf_terminal_jump`` = ov_cf[L-1] - mean(ov_cf[L-1-b .. L-2]), the terminal routed layer minus the mean
  of the band of the ``b = min(terminal_band, L-1)`` routed layers before it (negative: a cliff).
- ``ov_cf_adjacent_jump`` = ov_cf[L-1] - ov_cf[L-2] (the paper's "terminal adjacent jump", a band of one).
- ``ov_cf_cliff_ordinal``: the dominant cliff, the ordinal l >= 1 with the most negative adjacent step
  ov_cf[l] - ov_cf[l-1] (the earliest on a tie); None when no step is negative.
- ``ov_cf_cliff_note``: a sentence when the dominant cliff is not at the terminal routed layer (the
  falsifiable claim is that the cliff follows the terminal position), else None.

Each jump carries its window-bootstrap percentile CI: every resample re-pools all layers on the same
drawn windows, so the CI is that of the difference (docs/receipts.md#statistics). With fewer than two routed
layers every value is None.

Example:
    >>> import numpy as np
    >>> ov = [{"sum": [0.8, 0.8], "count": [1, 1]}, {"sum": [0.9, 0.7], "count": [1, 1]},
    ...       {"sum": [0.3, 0.2], "count": [1, 1]}]
    >>> out = terminal_cliff(ov, np.array([[0, 1], [1, 1], [0, 0]]), 0.95, band=2)
    >>> round(out["ov_cf_terminal_jump"], 3), round(out["ov_cf_adjacent_jump"], 3), out["ov_cf_cliff_ordinal"]
    (-0.55, -0.55, 2)
    >>> out["ov_cf_cliff_note"] is None
    True
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from atlas_tracking.receipts.stats import percentile_ci, pooled_ratios, ratio_sample_matrix

TERMINAL_BAND = 3
"""Default band: the routed layers before the terminal one whose mean ``ov_cf`` the terminal jump is taken
against."""

KEYS = ("ov_cf_profile", "ov_cf_terminal_jump", "ov_cf_terminal_jump_ci", "ov_cf_adjacent_jump",
        "ov_cf_adjacent_jump_ci", "ov_cf_terminal_band", "ov_cf_terminal_ordinal", "ov_cf_cliff_ordinal",
        "ov_cf_cliff_note")


def _f(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def terminal_cliff(ov_cf: list[dict[str, Any]], idx: np.ndarray, level: float,
                   band: int = TERMINAL_BAND) -> dict[str, Any]:
    """Profile, terminal and adjacent jumps (with CIs) and the dominant cliff, from per-layer ``{"sum", "count"}``
    per-window arrays of ``ov_cf`` listed in depth order."""
    out: dict[str, Any] = dict.fromkeys(KEYS)
    sums = np.array([np.asarray(e["sum"], np.float64) for e in ov_cf])  # [L, W]
    counts = np.array([np.asarray(e["count"], np.float64) for e in ov_cf])
    profile = pooled_ratios(sums, counts) if ov_cf else np.zeros(0)
    out["ov_cf_profile"] = [_f(v) for v in profile]
    n = len(profile)
    if n < 2:
        return out
    b = max(1, min(band, n - 1))
    samples = ratio_sample_matrix(sums, counts, idx).T  # [L, R]
    terminal = profile[-1] - profile[-1 - b:-1].mean()
    adjacent = profile[-1] - profile[-2]
    out["ov_cf_terminal_jump"], out["ov_cf_adjacent_jump"] = _f(terminal), _f(adjacent)
    out["ov_cf_terminal_jump_ci"] = [_f(v) for v in percentile_ci(samples[-1] - samples[-1 - b:-1].mean(0), level)]
    out["ov_cf_adjacent_jump_ci"] = [_f(v) for v in percentile_ci(samples[-1] - samples[-2], level)]
    out["ov_cf_terminal_band"] = b
    out["ov_cf_terminal_ordinal"] = n - 1
    steps = np.diff(profile)
    if np.isfinite(steps).any() and np.nanmin(steps) < 0:
        cliff = int(np.nanargmin(steps)) + 1
        out["ov_cf_cliff_ordinal"] = cliff
        if cliff != n - 1:
            out["ov_cf_cliff_note"] = (
                f"the dominant ov_cf cliff is at routed layer {cliff} (step {steps[cliff - 1]:+.3f}), not at the "
                f"terminal routed layer {n - 1} (step {steps[-1]:+.3f})")
    return out
