"""Angular geometry of normalised states (docs/receipts.md#notation, docs/receipts.md#layernorm-state; the
report's eq. 1-3, 10): the pre-gain state of an RMSNorm or of a mean-centred LayerNorm.

Example:
    >>> import torch
    >>> x = torch.tensor([[3.0, 4.0]])
    >>> z = rms_normalize(x, eps=0.0)
    >>> torch.allclose(z.norm(dim=-1), torch.tensor([2.0 ** 0.5]))
    True
    >>> zh = angular(z)
    >>> u = torch.tensor([[[1.0, 0.0]]])
    >>> v = tangent_project(u, zh)
    >>> float((v[0, 0] * zh[0]).sum().abs()) < 1e-7
    True
"""

from __future__ import annotations

import torch


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Canonical pre-gain state ``z = x / sqrt(mean(x^2) + eps)``, computed in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def layer_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Canonical pre-gain state of a LayerNorm, ``z = (x - mean(x)) / sqrt(var(x) + eps)`` with the population
    variance, computed in fp32 (docs/receipts.md#layernorm-state). ``z`` is orthogonal to the all-ones vector.

    >>> z = layer_normalize(torch.tensor([[1.0, 2.0, 6.0]]), eps=0.0)
    >>> round(float(z.sum()), 6), round(float(z.pow(2).mean()), 6)
    (0.0, 1.0)
    """
    x = x.float()
    centred = x - x.mean(-1, keepdim=True)
    return centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)


def angular(z: torch.Tensor) -> torch.Tensor:
    """Angular state ``zh = z / ||z||`` on the unit sphere (zero rows stay zero)."""
    norm = z.norm(dim=-1, keepdim=True)
    return z / norm.clamp_min(torch.finfo(z.dtype).tiny)


def tangent_project(u: torch.Tensor, zh: torch.Tensor) -> torch.Tensor:
    """Tangent-visible field ``v = u - (zh . u) zh``.

    ``u`` is ``[N, m, d]`` (m fields per token) or ``[N, d]``; ``zh`` is ``[N, d]``.
    """
    zh = zh if u.dim() == zh.dim() else zh.unsqueeze(1)
    return torch.addcmul(u, (u * zh).sum(-1, keepdim=True), zh, value=-1.0)  # one pass where a broadcast product is slow
