"""Smooth surrogates of the lifecycle margins (docs/receipts.md#smooth-margins) and their hard limits.

The theorem-facing margins replace every hard operation by a smooth one: top-k membership by
``sigmoid(beta_route (s_e - tau_t))`` with ``tau_t`` midway between the k-th and (k+1)-th
scores, minima and maxima by log-sum-exp (``smin``/``smax``), and the quantile over the active
set by smooth order statistics. Proposition 3: away from ties, as every beta grows they
converge to the exact receipts (docs/receipts.md#lifecycle-margins); ``tests`` check this
numerically. The occupancy ratios are the exact margins' ``(pi + 1/T) / (pi_ref + 1/T)``.

Example:
    >>> import torch
    >>> s = torch.tensor([[3.0, 2.0, 0.0]])
    >>> soft_membership(s, k=2, beta=50.0).round(decimals=3).tolist()
    [[1.0, 1.0, 0.0]]
"""

from __future__ import annotations

import itertools
import math

import torch

from atlas_tracking.receipts.lifecycle import occupancy_ratio
from atlas_tracking.receipts.state2 import kappa_matrix


def _smin(x: torch.Tensor, beta: float, dim: int) -> torch.Tensor:
    return -torch.logsumexp(-beta * x, dim=dim) / beta


def _smax(x: torch.Tensor, beta: float, dim: int) -> torch.Tensor:
    return torch.logsumexp(beta * x, dim=dim) / beta


def soft_membership(scores: torch.Tensor, k: int, beta: float) -> torch.Tensor:
    """Smooth top-k indicator ``sigmoid(beta (s_e - tau_t))``; ineligible (-inf) experts get 0."""
    top = scores.topk(k + 1, dim=1).values
    tau = 0.5 * (top[:, k - 1] + top[:, k])
    finite = torch.isfinite(scores)
    safe = torch.where(finite, scores, tau.unsqueeze(1))
    return torch.where(finite, torch.sigmoid(beta * (safe - tau.unsqueeze(1))), torch.zeros_like(scores))


def soft_rho(probs: torch.Tensor, membership: torch.Tensor) -> torch.Tensor:
    """Routing weights restricted smoothly to the active set and renormalised (-> rho on R_t)."""
    w = probs * membership
    return w / w.sum(dim=1, keepdim=True)


def smooth_c2(
    v_all: torch.Tensor, probs: torch.Tensor, scores: torch.Tensor, k: int, beta_route: float, beta_adj: float,
    eps_kappa: float,
) -> torch.Tensor:
    """Smooth overlap health (eq. 20-22) over all expert pairs; ``v_all`` is ``[N, E, d]``."""
    rho = soft_rho(probs, soft_membership(scores, k, beta_route))
    s = torch.where(torch.isfinite(scores), scores, torch.zeros_like(scores))
    w = rho.unsqueeze(2) * rho.unsqueeze(1) * torch.exp(-beta_adj * (s.unsqueeze(2) - s.unsqueeze(1)).abs())
    w = w * ~torch.eye(scores.shape[1], dtype=torch.bool, device=scores.device)
    w = w / w.sum(dim=(1, 2), keepdim=True)
    return (w * kappa_matrix(v_all, eps_kappa)).sum(dim=(1, 2)).mean()


def smooth_pi_tail(scores: torch.Tensor, k: int, beta_route: float, beta_pi: float) -> torch.Tensor:
    """Soft lower-tail occupancy: ``smin`` over experts of the mean soft membership (-> pi_min)."""
    pi = soft_membership(scores, k, beta_route).mean(dim=0)
    return _smin(pi, beta_pi, dim=0)


def smooth_boundary_drift(scores0: torch.Tensor, scores1: torch.Tensor, k: int, beta_route: float) -> torch.Tensor:
    """``E_t [1 - sum_e m0 m1 / k]`` with soft memberships (-> boundary_drift)."""
    m0 = soft_membership(scores0, k, beta_route)
    m1 = soft_membership(scores1, k, beta_route)
    return (1.0 - (m0 * m1).sum(dim=1) / k).mean()


def smooth_order_statistic(x: torch.Tensor, j: int, beta: float) -> torch.Tensor:
    """Smooth j-th smallest value (0-based) of each row: smax over (k-j)-subsets of their smin."""
    k = x.shape[1]
    subsets = list(itertools.combinations(range(k), k - j))
    mins = torch.stack([_smin(x[:, list(sub)], beta, dim=1) for sub in subsets], dim=1)
    return _smax(mins, beta, dim=1)


def smooth_quantile(x: torch.Tensor, q: float, beta: float) -> torch.Tensor:
    """Linear-interpolation quantile of each row built on smooth order statistics (-> torch.quantile)."""
    k = x.shape[1]
    pos = q * (k - 1)
    lo = math.floor(pos)
    frac = pos - lo
    low = smooth_order_statistic(x, lo, beta)
    if frac == 0.0:
        return low
    return low + frac * (smooth_order_statistic(x, lo + 1, beta) - low)


def smooth_content_drift(ratios: torch.Tensor, q: float, beta: float) -> torch.Tensor:
    """Mean over tokens of the smooth q-quantile of the base active set's content ratios ``[N, k]``."""
    return smooth_quantile(ratios, q, beta).mean()


def smooth_handoff_margin(
    c2: torch.Tensor, c2_ref: torch.Tensor, pi_tail: torch.Tensor, pi_tail_ref: torch.Tensor,
    lam1: float, lam2: float, beta_h: float, n_tokens: int,
) -> torch.Tensor:
    """``smin_{beta_h}`` over protected layers of ``lam1 (C2 - C2_ref) + lam2 (pi/pi_ref - 1)`` (eq. 25-26)."""
    m = lam1 * (c2 - c2_ref) + lam2 * (occupancy_ratio(pi_tail, pi_tail_ref, n_tokens) - 1.0)
    return _smin(m, beta_h, dim=0)


def smooth_refine_margin(
    boundary: torch.Tensor, content: torch.Tensor, pi_tail: torch.Tensor, pi_tail_base: torch.Tensor,
    mu: tuple[float, float, float], tau: float, beta_r: float, n_tokens: int,
) -> torch.Tensor:
    """``tau - smax_{beta_r}`` over protected layers of the repurposing load (eq. 29-30)."""
    mu1, mu2, mu3 = mu
    load = mu1 * boundary + mu2 * content + mu3 * (1.0 - occupancy_ratio(pi_tail, pi_tail_base, n_tokens))
    return tau - _smax(load, beta_r, dim=0)
