"""The fixed random projection compact baselines keep their base fields in (docs/receipts.md#compact-anchors).

>>> u = torch.ones(2, 3, 8)
>>> project(u, sketch_matrix(4, 8, 0)).shape
torch.Size([2, 3, 4])
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch


@lru_cache(maxsize=8)
def sketch_matrix(m: int, d: int, seed: int) -> torch.Tensor:
    """The ``m x d`` Gaussian projection, entries N(0, 1/m), drawn on the CPU from ``seed`` (so the same matrix
    on every device and platform; callers move it to the model's device).

    >>> s = sketch_matrix(4, 8, 0)
    >>> s.shape, bool((s == sketch_matrix(4, 8, 0)).all())
    (torch.Size([4, 8]), True)
    """
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, d, generator=gen, dtype=torch.float32) / math.sqrt(m)


def project(u: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """``S u`` for each row of ``u`` (``[..., d]`` -> ``[..., m]``), in float32: one and the same product at the
    baseline and at every gate."""
    return torch.matmul(u.float(), sketch.t())
