"""Routing self-consistency ``ov_cf`` (docs/receipts.md#routing-self-consistency): does the router keep its choice after its own update?

Example:
    >>> import torch
    >>> set_overlap(torch.tensor([[0, 1], [2, 3]]), torch.tensor([[1, 0], [2, 5]])).tolist()
    [1.0, 0.5]
"""

from __future__ import annotations

import torch


def set_overlap(active_a: torch.Tensor, active_b: torch.Tensor) -> torch.Tensor:
    """Per-token ``|R_a ∩ R_b| / k`` for two ``[N, k]`` active sets (order inside a set is ignored)."""
    k = active_a.shape[1]
    hits = (active_a.unsqueeze(2) == active_b.unsqueeze(1)).sum(dim=(1, 2))  # a set holds each expert once
    return hits.to(torch.float32) / k
