"""Drift between checkpoints on base-anchored states (docs/receipts.md#drift-between-checkpoints).

Per anchor token: coordinate (transport), boundary and transition (routing) and content
(experts) drift. Identical inputs give exactly 0: every formula is written so that equal
operands cancel exactly in floating point.

Example:
    >>> import torch
    >>> a = torch.tensor([[1.0, 2.0, 3.0]])
    >>> one_minus_cos(a, a).tolist(), round(one_minus_cos(a, -a).item(), 5)
    ([0.0], 2.0)
    >>> p = torch.tensor([[0.5, 0.5, 0.0]])
    >>> js_divergence(p, p).tolist()
    [0.0]
    >>> round(float(js_divergence(p, torch.tensor([[0.0, 0.5, 0.5]]))[0]), 4)
    0.3466
"""

from __future__ import annotations

import torch


def one_minus_cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``1 - cos(a, b)`` as ``||a/|a| - b/|b|||^2 / 2``: exactly 0 for equal rows, in [0, 2]."""
    tiny = torch.finfo(torch.float32).tiny
    ah = a.float() / a.float().norm(dim=-1, keepdim=True).clamp_min(tiny)
    bh = b.float() / b.float().norm(dim=-1, keepdim=True).clamp_min(tiny)
    return 0.5 * (ah - bh).pow(2).sum(dim=-1)


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence (nats) between rows of two distributions, with 0 log 0 = 0."""
    p, q = p.float(), q.float()
    m = 0.5 * (p + q)

    def kl(a: torch.Tensor) -> torch.Tensor:
        ratio = torch.where(a > 0, a / m.clamp_min(torch.finfo(m.dtype).tiny), torch.ones_like(a))
        return (a * torch.log(ratio)).sum(dim=-1)

    return 0.5 * kl(p) + 0.5 * kl(q)


def content_ratio(u1: torch.Tensor, u0: torch.Tensor, eps: float) -> torch.Tensor:
    """``||u1 - u0|| / (||u1|| + ||u0|| + eps)`` per field (``[N, k, d]`` -> ``[N, k]``), in [0, 1]."""
    return (u1 - u0).norm(dim=-1) / (u1.norm(dim=-1) + u0.norm(dim=-1) + eps)


def content_drift_per_token(u1: torch.Tensor, u0: torch.Tensor, eps: float, quantile: float,
                            carries: torch.Tensor | None = None) -> torch.Tensor:
    """Quantile over the base active set of :func:`content_ratio` (linear interpolation), per token.

    With ``carries`` (``[N, k]`` bool), over the experts of the set that carry a field only, NaN for a token with
    none (zero-computation experts have no parameters; docs/receipts.md#zero-computation-experts).

    >>> u0 = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    >>> u1 = torch.tensor([[[1.0, 0.0], [0.0, -1.0]]])
    >>> content_drift_per_token(u1, u0, 0.0, 0.9, torch.tensor([[True, False]])).tolist()
    [0.0]
    """
    ratio = content_ratio(u1, u0, eps)
    if carries is None:
        return torch.quantile(ratio, quantile, dim=1)
    return torch.nanquantile(ratio.masked_fill(~carries, float("nan")), quantile, dim=1)


def active_set_change(r0: torch.Tensor, r1: torch.Tensor) -> torch.Tensor:
    """``1 - |R0 ∩ R1| / k`` per token (the boundary-drift integrand)."""
    k = r0.shape[1]
    hits = (r0.unsqueeze(2) == r1.unsqueeze(1)).any(dim=2).sum(dim=1)
    return (k - hits).float() / k
