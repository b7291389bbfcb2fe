"""State1: set margins, competitors and the per-window boundary set (docs/receipts.md#state1-boundary).

Example:
    >>> import torch
    >>> scores = torch.tensor([[3.0, 1.0, 2.0, float("-inf")]])
    >>> active = torch.tensor([[0, 2]])
    >>> m = set_margin(scores, active)
    >>> m.margin.tolist(), m.e_k.tolist(), m.e_k1.tolist(), m.valid.tolist()
    ([1.0], [2], [1], [True])
    >>> boundary_set(torch.tensor([[0.3, 0.1, 0.2, 0.4]]), torch.ones(1, 4, dtype=torch.bool), q=0.5).tolist()
    [[False, True, True, False]]
    >>> near_ties(m, NEAR_TIE_DTYPES.values()).tolist()   # |m| = 1 is far above bf16's rounding of |3| + |1|
    [[False], [False]]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

_CEIL_SLACK = 1e-9
"""ceil(q*T) is taken as ceil(q*T - 1e-9) so that e.g. 0.1 * 30 = 3.0000000000000004 counts as 3."""


@dataclass
class SetMargin:
    """Per-token set margin and the two competitors around the top-k boundary."""

    margin: torch.Tensor
    """``s[e_k] - s[e_k1]`` (0 where invalid)."""
    e_k: torch.Tensor
    """Lowest-scoring selected expert."""
    e_k1: torch.Tensor
    """Best unselected eligible expert."""
    valid: torch.Tensor
    """False where no eligible competitor exists (the token is excluded from State1 and V2)."""
    s_k: torch.Tensor
    """The selection score of ``e_k``."""
    s_k1: torch.Tensor
    """The selection score of ``e_k1`` (``-inf`` where invalid)."""


def set_margin(scores: torch.Tensor, active: torch.Tensor) -> SetMargin:
    """Set margin ``m = s[e_k] - s[e_k1]`` in selection-score units.

    ``scores`` is ``[N, E]`` fp32 with ``-inf`` for ineligible experts; ``active`` is the
    ``[N, k]`` active set actually used. ``e_k`` is the lowest-scoring member of the active
    set, ``e_k1`` the best eligible expert outside it.
    """
    s_active = scores.gather(1, active)
    pos_k = s_active.argmin(dim=1, keepdim=True)
    e_k = active.gather(1, pos_k).squeeze(1)
    outside = scores.scatter(1, active, float("-inf"))
    s_k1, e_k1 = outside.max(dim=1)
    valid = torch.isfinite(s_k1)
    s_k = s_active.gather(1, pos_k).squeeze(1)
    margin = torch.where(valid, s_k - s_k1, torch.zeros_like(s_k))
    return SetMargin(margin=margin, e_k=e_k, e_k1=e_k1, valid=valid, s_k=s_k, s_k1=s_k1)


NEAR_TIE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The precisions a gate reports near-tie mass at, by their names in the receipts (docs/receipts.md#near-tie-mass)."""


def tie_scale(sm: SetMargin) -> torch.Tensor:
    """``|s_k| + |s_k1|``: the size of the two scores that a rounding bound on their order is relative to (0 where
    it is not finite: a token without a competitor, or whose active set holds an ineligible expert)."""
    return torch.nan_to_num(sm.s_k.abs() + sm.s_k1.abs(), nan=0.0, posinf=0.0)


def near_ties(sm: SetMargin, dtypes: Iterable[torch.dtype]) -> torch.Tensor:
    """``[P, N]``: per precision ``p`` of ``dtypes``, the tokens with a competitor whose set margin lies within the
    rounding of a tie at ``p``: ``|m| <= eps_p (|s_k| + |s_k1|)``, ``eps_p = torch.finfo(p).eps``, in fp32.

    An exact tie is a near tie at every precision, zero scores included; a token without an eligible competitor is
    none:

    >>> inf = float("inf")
    >>> scores = torch.tensor([[1.0, 0.995, 0.0], [1.0, 0.5, 0.0], [0.0, 0.0, -inf], [2.0, -inf, -inf]])
    >>> sm = set_margin(scores, torch.tensor([[0], [0], [0], [0]]))
    >>> near_ties(sm, [torch.bfloat16, torch.float16]).tolist()   # 0.005 <= 2^-7 x 1.995, > 2^-10 x 1.995
    [[True, False, True, False], [False, False, True, False]]
    """
    scale, size = tie_scale(sm), sm.margin.abs()
    return torch.stack([(size <= torch.finfo(p).eps * scale) & sm.valid for p in dtypes])


def boundary_set(margins: torch.Tensor, valid: torch.Tensor, q: float) -> torch.Tensor:
    """Boundary mask B_w: the ``ceil(q * T_w)`` valid tokens of each window with the smallest margin.

    ``margins`` and ``valid`` are ``[W, L]`` (one row per canary window). Ties are broken by
    position (a stable sort), so the set is deterministic. Invalid tokens are never in B_w.
    """
    return boundary_set_and_order(margins, valid, q)[0]


def boundary_set_and_order(margins: torch.Tensor, valid: torch.Tensor, q: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`boundary_set` and the ``[W, L]`` positions of each window by increasing margin (invalid last),
    from one stable sort: the first ``ceil(q * T_w)`` positions of a row are its boundary set."""
    keyed = torch.where(valid, margins, torch.full_like(margins, float("inf")))
    order = torch.sort(keyed, dim=1, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    n_b = _count_table(margins.shape[1], q, margins.device)[valid.sum(dim=1, keepdim=True)]
    return (rank < n_b) & valid, order


@functools.lru_cache(maxsize=64)
def _count_table(length: int, q: float, device: torch.device) -> torch.Tensor:
    """``boundary_count(t, q)`` for t = 0..length, on the device once (no host copy per layer call)."""
    return torch.tensor([boundary_count(t, q) for t in range(length + 1)], device=device)


def boundary_count(t_w: int, q: float) -> int:
    """``ceil(q * T_w)``, the size of a window's boundary set (exact, in float64 on the host).

    >>> boundary_count(30, 0.1), boundary_count(25, 0.1), boundary_count(0, 0.1)
    (3, 3, 0)
    """
    return math.ceil(q * t_w - _CEIL_SLACK)


def q_eff(t_w: int, q: float) -> float:
    """Null rate of the boundary set: ``ceil(q * T_w) / T_w`` (docs/receipts.md#v2-axes), not ``q``.

    >>> q_eff(25, 0.1)
    0.12
    """
    if t_w <= 0:
        raise ValueError("q_eff needs a window with at least one token")
    return boundary_count(t_w, q) / t_w
