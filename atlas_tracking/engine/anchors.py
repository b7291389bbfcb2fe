"""Anchor tokens: the fixed subset of canary positions on which drift is measured.

Anchors are sorted flat positions ``window * L + position``; the anchors of each forward
micro-batch are therefore a contiguous slice of the anchor list.

Example:
    >>> import numpy as np
    >>> from atlas_tracking.engine.canary import Canary
    >>> c = Canary(windows=np.zeros((4, 8), dtype=np.int64))
    >>> plan = AnchorPlan.select(c, n_anchors=6, seed=0)
    >>> len(plan.positions), plan.slice_for(0, 2)[0] <= plan.slice_for(0, 2)[1]
    (6, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from atlas_tracking.engine.canary import Canary


@dataclass
class AnchorPlan:
    """Sorted flat canary positions of the anchors and the window length."""

    positions: np.ndarray
    window: int

    @classmethod
    def select(cls, canary: Canary, n_anchors: int, seed: int) -> AnchorPlan:
        """``min(n_anchors, canary tokens)`` distinct positions drawn with a fixed seed."""
        n = min(n_anchors, canary.n_tokens)
        rng = np.random.default_rng([seed, 0xA7C4])
        positions = np.sort(rng.choice(canary.n_tokens, size=n, replace=False)).astype(np.int64)
        return cls(positions=positions, window=canary.window)

    def device_slices(self, batches: list[tuple[int, int]], device) -> dict[tuple[int, int], tuple[int, int, Any]]:
        """``slice_for`` of every micro-batch, with the local positions already on ``device``: all micro-batches' in
        one copy from the host (each a copy of its own would wait for the device at every micro-batch)."""
        import torch

        slices = [self.slice_for(start, end) for start, end in batches]
        local = torch.from_numpy(np.concatenate([loc for _, _, loc in slices] or [np.zeros(0, np.int64)])).to(device)
        parts = torch.split(local, [len(loc) for _, _, loc in slices])
        return {batch: (a0, a1, part) for batch, (a0, a1, _), part in zip(batches, slices, parts)}

    def slice_for(self, start_window: int, end_window: int) -> tuple[int, int, np.ndarray]:
        """Anchor index range ``[a0, a1)`` inside windows ``[start, end)`` and their local flat positions."""
        lo, hi = start_window * self.window, end_window * self.window
        a0 = int(np.searchsorted(self.positions, lo, side="left"))
        a1 = int(np.searchsorted(self.positions, hi, side="left"))
        return a0, a1, self.positions[a0:a1] - lo
