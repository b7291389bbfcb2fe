"""One chunk of a gate's per-token field arithmetic as one function (docs/receipts.md#field-kernels).

A gate evaluates each routed layer's expert fields chunk by chunk (``LayerCapture.fields``) and keeps only
per-token reductions of them: State2's C2 from the Gram matrix of the active tangent fields, the tangent field of
``e_k``, the redundancy distance to the adjacent competitor, the one-swap jump and, for the router-expert coupling,
each expert's summed tangent fields. :func:`chunk_receipts` is that arithmetic for one chunk, built from
``geometry`` and ``state2``. It reads the fields in the model's dtype and casts them to fp32 itself, so a compiled
version (``engine/kernels.py``) fuses the cast into the projection and no fp32 copy of the ``[tokens, k, d]``
fields is made.

Example:
    >>> import torch
    >>> u = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])    # two active fields of one token
    >>> zh = torch.tensor([[0.0, 0.0, 1.0]])
    >>> r = chunk_receipts(u, torch.tensor([[1.0, 0.0, 0.0]]), zh, torch.tensor([[0.5, 0.5]]), torch.zeros(1, 2),
    ...                    torch.ones(1, 2, dtype=torch.bool), torch.tensor([1]), torch.tensor([0.5]), 1.0, 0.0, 0.0)
    >>> float(r.c2[0]), bool(r.c2_ok[0]), r.v_k.tolist(), round(float(r.d_adj[0]), 6), round(float(r.jump[0]), 6)
    (0.0, True, [[0.0, 1.0, 0.0]], 0.707107, 1.0)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from atlas_tracking.receipts.coupling import field_sum
from atlas_tracking.receipts.geometry import tangent_project
from atlas_tracking.receipts.state2 import c2_from_gram, jump_ratio, redundancy_distance


class ChunkReceipts(NamedTuple):
    """What a gate keeps of one chunk's fields, per token, in fp32."""

    c2: torch.Tensor
    """``[n]`` co-active overlap compatibility (State2)."""
    c2_ok: torch.Tensor
    """``[n]`` the token has a weighted pair (its C2 counts)."""
    v_k: torch.Tensor
    """``[n, d]`` tangent field of ``e_k``, the active expert with the smallest selection score."""
    d_adj: torch.Tensor | None
    """``[n]`` redundancy distance of ``e_k`` and its adjacent competitor ``e_k1`` (None without its field)."""
    jump: torch.Tensor | None
    """``[n]`` one-swap jump ``rho_k ||v_k - v_k1|| / ||sum_e rho_e v_e||`` (None without ``e_k1``'s field)."""
    field_sum: torch.Tensor | None
    """``[E, d]`` float64 sum of the active tangent fields per expert (None where not asked for)."""
    field: torch.Tensor
    """``[n, d]`` the routed tangent field ``sum_e rho_e v_e`` (the jump's denominator)."""


def chunk_receipts(
    u_active: torch.Tensor, u_adj: torch.Tensor | None, zh: torch.Tensor, rho: torch.Tensor, s_active: torch.Tensor,
    carriers: torch.Tensor, pos_k: torch.Tensor, rho_k: torch.Tensor, beta_adj: float, eps_kappa: float,
    eps_d: float, experts: torch.Tensor | None = None, n_experts: int = 0,
) -> ChunkReceipts:
    """The per-token receipts of one chunk of ``n`` tokens.

    ``u_active`` ``[n, k, d]`` the active fields and ``u_adj`` ``[n, d]`` the adjacent competitor's, in the model's
    dtype (None: the distance and the jump are left to :func:`adjacent_receipts`, once that field is evaluated);
    ``zh`` ``[n, d]`` the unit states; ``rho``, ``s_active`` and ``carriers`` ``[n, k]`` the renormalised routing
    weights, selection scores and field-carrier mask of the active slots; ``pos_k`` ``[n]`` the slot of
    ``e_k`` and ``rho_k`` its weight; ``beta_adj``, ``eps_kappa``, ``eps_d`` the receipts' constants. With
    ``experts`` (``[n, k]``, the expert of each slot) the per-expert field sums of ``n_experts`` experts too.
    """
    n, k, d = u_active.shape
    v = tangent_project(u_active.float(), zh)  # projected before any inner product (docs/receipts.md#precision)
    sums = None if experts is None else field_sum(v, experts, n_experts)
    c2, c2_ok = c2_from_gram(torch.bmm(v, v.transpose(1, 2)), rho, s_active, beta_adj, eps_kappa, carriers)
    v_k = v.view(-1, d).index_select(0, torch.arange(0, n * k, k, device=v.device) + pos_k)  # rows, not a gather
    field = torch.bmm((rho * carriers).unsqueeze(1), v).squeeze(1)
    d_adj, jump = (None, None) if u_adj is None else adjacent_receipts(u_adj, zh, v_k, field, rho_k, eps_d)
    return ChunkReceipts(c2, c2_ok, v_k, d_adj, jump, sums, field)


def adjacent_receipts(u_adj: torch.Tensor, zh: torch.Tensor, v_k: torch.Tensor, field: torch.Tensor,
                      rho_k: torch.Tensor, eps_d: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_adj, jump)`` ``[n]`` of a chunk from the adjacent competitor's field ``u_adj`` ``[n, d]`` (the model's
    dtype) and what :func:`chunk_receipts` kept of the active fields: ``v_k`` and the routed ``field`` ``[n, d]``, with
    the unit states ``zh`` and ``e_k``'s weight ``rho_k``; the same arithmetic as there."""
    v_k1 = tangent_project(u_adj.float(), zh)
    gap = (v_k - v_k1).norm(dim=-1)  # ||v_k - v_k1||: read by the distance and the jump
    return redundancy_distance(v_k, v_k1, eps_d, gap), jump_ratio(rho_k, gap, field)


def random_distance(u_rand: torch.Tensor, zh: torch.Tensor, v_k: torch.Tensor, b_pos: torch.Tensor,
                    eps_d: float) -> torch.Tensor:
    """``[M]`` redundancy distance of ``e_k`` and the random competitor at the boundary candidates ``b_pos`` ``[M]``,
    from that competitor's field ``u_rand`` ``[M, d]`` (the model's dtype), the chunk's unit states ``zh`` and the
    tangent field of ``e_k``, ``v_k`` (``[n, d]``, every token)."""
    v_rand = tangent_project(u_rand.float(), zh.index_select(0, b_pos))
    return redundancy_distance(v_k.index_select(0, b_pos), v_rand, eps_d)
