"""Routing self-consistency ``ov_cf`` (docs/receipts.md#routing-self-consistency): does the router keep its choice after its own update?

Example:
    >>> import torch
    >>> set_overlap(torch.tensor([[0, 1], [2, 3]]), torch.tensor([[1, 0], [2, 5]]), n_experts=6).tolist()
    [1.0, 0.5]
"""

from __future__ import annotations

import torch


def set_overlap(active_a: torch.Tensor, active_b: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Per-token ``|R_a ∩ R_b| / k`` for two ``[N, k]`` active sets of expert ids below ``n_experts`` (order
    inside a set is ignored): ``R_a`` as ``[N, E]`` indicators, read at ``R_b`` (a set holds each expert once)."""
    k = active_a.shape[1]
    member = torch.zeros(active_a.shape[0], n_experts, dtype=torch.bool, device=active_a.device)
    hits = member.scatter_(1, active_a, True).gather(1, active_b).sum(dim=1)
    return hits.to(torch.float32) / k
