"""State2: co-active overlap compatibility, redundancy distance and the one-swap jump.

All functions work per token on tangent-visible fields ``v`` (RECEIPTS.md, State2;
seeds/000 eq. 14, 20-22).

Example:
    >>> import torch
    >>> v = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])           # two identical co-active fields
    >>> rho = torch.tensor([[0.5, 0.5]])
    >>> s = torch.tensor([[1.0, 1.0]])
    >>> c2, ok = c2_per_token(v, rho, s, beta_adj=1.0, eps_kappa=0.0)
    >>> round(float(c2[0]), 6), bool(ok[0])
    (1.0, True)
    >>> float(redundancy_distance(v[:, 0], -v[:, 1], eps=0.0)[0])
    1.0
"""

from __future__ import annotations

import torch


def kappa_matrix(v: torch.Tensor, eps_kappa: float) -> torch.Tensor:
    """``kappa(e, e') = <v_e, v_e'> / (||v_e|| ||v_e'|| + eps)`` for all pairs of a token's fields.

    ``v`` is ``[N, m, d]``; the result is ``[N, m, m]`` with entries in ``[-1, 1]``.
    """
    gram = v @ v.transpose(1, 2)
    norms = v.norm(dim=-1)
    return gram / (norms.unsqueeze(2) * norms.unsqueeze(1) + eps_kappa)


def pair_weights(rho: torch.Tensor, s_active: torch.Tensor, beta_adj: float) -> torch.Tensor:
    """Adjacency weights ``w(e,e') ∝ rho_e rho_e' exp(-beta_adj |s_e - s_e'|)`` over ordered pairs e != e'.

    Normalised to sum to 1 over the ordered pairs of each token's active set (seeds/000 eq. 21).
    """
    k = rho.shape[1]
    w = rho.unsqueeze(2) * rho.unsqueeze(1) * torch.exp(-beta_adj * (s_active.unsqueeze(2) - s_active.unsqueeze(1)).abs())
    off_diag = ~torch.eye(k, dtype=torch.bool, device=rho.device)
    w = w * off_diag
    total = w.sum(dim=(1, 2), keepdim=True)
    return w / total.clamp_min(torch.finfo(w.dtype).tiny)


def c2_per_token(
    v: torch.Tensor, rho: torch.Tensor, s_active: torch.Tensor, beta_adj: float, eps_kappa: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token overlap compatibility ``sum_{e != e'} w(e,e') kappa(e,e')`` and its validity.

    ``v`` is ``[N, k, d]`` (fields of the active set), ``rho`` the renormalised routing
    weights ``[N, k]``, ``s_active`` the selection scores of the active set. A token is
    invalid when it has no pair (k = 1) or all pair weights vanish.
    """
    k = v.shape[1]
    if k < 2:
        zeros = torch.zeros(v.shape[0], device=v.device, dtype=v.dtype)
        return zeros, torch.zeros(v.shape[0], device=v.device, dtype=torch.bool)
    w = pair_weights(rho, s_active, beta_adj)
    kap = kappa_matrix(v, eps_kappa)
    c2 = (w * kap).sum(dim=(1, 2))
    valid = w.sum(dim=(1, 2)) > 0.5
    return c2, valid


def redundancy_distance(va: torch.Tensor, vb: torch.Tensor, eps: float) -> torch.Tensor:
    """``D(a, b) = ||v_a - v_b|| / (||v_a|| + ||v_b|| + eps)`` in ``[0, 1]`` (seeds/002)."""
    return (va - vb).norm(dim=-1) / (va.norm(dim=-1) + vb.norm(dim=-1) + eps)


def swap_jump(v_active: torch.Tensor, rho: torch.Tensor, pos_k: torch.Tensor, v_k1: torch.Tensor) -> torch.Tensor:
    """Scale-free one-swap jump ``||rho_{e_k} (v_{e_k1} - v_{e_k})|| / ||sum_e rho_e v_e||`` (seeds/000 eq. 14).

    ``pos_k`` is the position of ``e_k`` inside the active set (``[N]``).
    """
    idx = pos_k.view(-1, 1, 1).expand(-1, 1, v_active.shape[-1])
    v_k = v_active.gather(1, idx).squeeze(1)
    rho_k = rho.gather(1, pos_k.view(-1, 1))
    jump = (rho_k * (v_k1 - v_k)).norm(dim=-1)
    field = (rho.unsqueeze(-1) * v_active).sum(dim=1).norm(dim=-1)
    return jump / field.clamp_min(torch.finfo(field.dtype).tiny)
