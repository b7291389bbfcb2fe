"""State2: co-active overlap compatibility, redundancy distance and the one-swap jump.

All functions work per token on tangent-visible fields ``v`` (docs/receipts.md#state2-co-active-overlap-compatibility;
the report's eq. 14, 20-22).

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

from atlas_tracking.receipts.geometry import tangent_project


def kappa_matrix(v: torch.Tensor, eps_kappa: float) -> torch.Tensor:
    """``kappa(e, e') = <v_e, v_e'> / (||v_e|| ||v_e'|| + eps)`` for all pairs of a token's fields.

    ``v`` is ``[N, m, d]``; the result is ``[N, m, m]`` with entries in ``[-1, 1]``.
    """
    return kappa_from_gram(v @ v.transpose(1, 2), eps_kappa)


def kappa_from_gram(gram: torch.Tensor, eps_kappa: float) -> torch.Tensor:
    """:func:`kappa_matrix` from the ``[N, m, m]`` Gram matrix of the fields (norms on its diagonal).

    Clamped to ``[-1, 1]``: a Gram matrix of explicit vectors satisfies Cauchy-Schwarz, and the clamp
    removes the last rounding of the division.
    """
    return _kappa_pairs_first(gram.permute(1, 2, 0), eps_kappa).permute(2, 0, 1)


def _kappa_pairs_first(gram: torch.Tensor, eps_kappa: float) -> torch.Tensor:
    """:func:`kappa_from_gram` of a ``[m, m, N]`` Gram matrix (tokens last: the pair products run along the
    tokens, not over a broadcast of ``m``, which is several times slower on a CPU)."""
    norms = gram.diagonal().T.clamp_min(0.0).sqrt()
    return (gram / (norms.unsqueeze(1) * norms.unsqueeze(0) + eps_kappa)).clamp(-1.0, 1.0)


def tangent_gram(u: torch.Tensor, zh: torch.Tensor) -> torch.Tensor:
    """Gram matrix ``<v_e, v_e'>`` of the tangent-visible fields ``v = u - (zh . u) zh``, ``[N, m, m]``.

    ``u`` is ``[N, m, d]``, ``zh`` the unit states ``[N, d]``. The fields are projected first and their
    inner products taken after, so the matrix is positive semidefinite by construction: an expert whose
    output is nearly parallel to its input (an identity or near-identity expert) has a small tangent part
    whose rounding error is relative to ``||u||``, never a negative squared norm (forming
    ``<u_e, u_e'> - a_e a_e'`` by subtraction cancels there; docs/receipts.md#precision).
    """
    v = tangent_project(u, zh)
    return torch.bmm(v, v.transpose(1, 2))


def pair_weights(rho: torch.Tensor, s_active: torch.Tensor, beta_adj: float,
                 carries: torch.Tensor | None = None) -> torch.Tensor:
    """Adjacency weights ``w(e,e') ∝ rho_e rho_e' exp(-beta_adj |s_e - s_e'|)`` over ordered pairs e != e'.

    Normalised to sum to 1 over the ordered pairs of each token's active set (the report's eq. 21). ``carries``
    (``[N, k]`` bool) marks the active experts that carry a field: a pair with a zero-computation expert has
    weight 0 and the weights are renormalised over the field-carrying pairs; a token with fewer than two such
    experts has no pair (all weights 0; docs/receipts.md#zero-computation-experts).

    >>> rho, s = torch.tensor([[0.5, 0.3, 0.2]]), torch.zeros(1, 3)
    >>> pair_weights(rho, s, 1.0, torch.tensor([[True, False, True]]))[0].tolist()
    [[0.0, 0.0, 0.5], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0]]
    """
    w = _pair_terms(rho, s_active, beta_adj, carries)
    return (w / w.sum(dim=(0, 1)).clamp_min(torch.finfo(w.dtype).tiny)).permute(2, 0, 1)


def _pair_terms(rho: torch.Tensor, s_active: torch.Tensor, beta_adj: float, carries: torch.Tensor | None
                ) -> torch.Tensor:
    """The unnormalised :func:`pair_weights` of ``[N, k]`` inputs, tokens last: ``[k, k, N]``, zero diagonal."""
    r = (rho if carries is None else rho * carries).T.contiguous()
    s = s_active.T.contiguous()
    w = r.unsqueeze(1) * r.unsqueeze(0) * torch.exp(-beta_adj * (s.unsqueeze(1) - s.unsqueeze(0)).abs())
    w.diagonal().zero_()
    return w


def c2_per_token(
    v: torch.Tensor, rho: torch.Tensor, s_active: torch.Tensor, beta_adj: float, eps_kappa: float,
    carries: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token overlap compatibility ``sum_{e != e'} w(e,e') kappa(e,e')`` and its validity.

    ``v`` is ``[N, k, d]`` (fields of the active set), ``rho`` the renormalised routing
    weights ``[N, k]``, ``s_active`` the selection scores of the active set, ``carries`` which active
    experts carry a field (None: all; see :func:`pair_weights`). A token is invalid when it has no pair
    (k = 1, or fewer than two field-carrying experts) or all pair weights vanish.
    """
    return c2_from_gram(v @ v.transpose(1, 2), rho, s_active, beta_adj, eps_kappa, carries)


def c2_from_gram(
    gram: torch.Tensor, rho: torch.Tensor, s_active: torch.Tensor, beta_adj: float, eps_kappa: float,
    carries: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`c2_per_token` from the ``[N, k, k]`` Gram matrix of the active fields."""
    k = gram.shape[1]
    if k < 2:
        zeros = torch.zeros(gram.shape[0], device=gram.device, dtype=gram.dtype)
        return zeros, torch.zeros(gram.shape[0], device=gram.device, dtype=torch.bool)
    w = _pair_terms(rho, s_active, beta_adj, carries)
    total, tiny = w.sum(dim=(0, 1)), torch.finfo(w.dtype).tiny
    c2 = (w * _kappa_pairs_first(gram.permute(1, 2, 0).contiguous(), eps_kappa)).sum(dim=(0, 1))
    return c2 / total.clamp_min(tiny), total > 0.5 * tiny  # valid: the weights normalise


def redundancy_distance(va: torch.Tensor, vb: torch.Tensor, eps: float, gap: torch.Tensor | None = None) -> torch.Tensor:
    """``D(a, b) = ||v_a - v_b|| / (||v_a|| + ||v_b|| + eps)`` in ``[0, 1]`` (docs/receipts.md#v2-axes); ``gap`` is
    ``||v_a - v_b||`` where the caller already has it (the one-swap jump reads the same norm)."""
    gap = (va - vb).norm(dim=-1) if gap is None else gap
    return gap / (va.norm(dim=-1) + vb.norm(dim=-1) + eps)


def swap_jump(v_active: torch.Tensor, rho: torch.Tensor, pos_k: torch.Tensor, v_k1: torch.Tensor) -> torch.Tensor:
    """Scale-free one-swap jump ``||rho_{e_k} (v_{e_k1} - v_{e_k})|| / ||sum_e rho_e v_e||`` (the report's eq. 14).

    ``pos_k`` is the position of ``e_k`` inside the active set (``[N]``).
    """
    idx = pos_k.view(-1, 1, 1).expand(-1, 1, v_active.shape[-1])
    v_k = v_active.gather(1, idx).squeeze(1)
    field = (rho.unsqueeze(-1) * v_active).sum(dim=1)
    return jump_ratio(rho.gather(1, pos_k.view(-1, 1)).squeeze(1), (v_k1 - v_k).norm(dim=-1), field)


def jump_ratio(rho_k: torch.Tensor, gap: torch.Tensor, field: torch.Tensor) -> torch.Tensor:
    """:func:`swap_jump` from its parts: ``rho_{e_k}`` ``[N]``, the swap's field gap ``||v_{e_k1} - v_{e_k}||``
    ``[N]`` and the routed tangent field ``sum_e rho_e v_e`` ``[N, d]``."""
    jump = rho_k * gap
    norm = field.norm(dim=-1)
    return jump / norm.clamp_min(torch.finfo(norm.dtype).tiny)
