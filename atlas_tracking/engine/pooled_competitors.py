"""The competitors' products of a layer's micro-batches pooled into one call of its experts
(docs/receipts.md#pooled-competitors).

On the CPU a grouped product is one matrix product per expert, whatever its rows: the adjacent and random
competitors of one micro-batch (an eighth of its active rows at k = 8) spread over almost every expert in products
of a few rows each, and cost nearly what the active rows cost (``benchmarks/RESULTS.md`` (w)). So on the CPU, where
the experts run transformers' ``grouped_mm`` as grouped products (``RoutedLayer.pools_pairs``: wider experts already
evaluate the competitors in the active set's pass) and are held here, a gate keeps each kept micro-batch's competitor rows
and what the distances read of its active fields (the tangent field of ``e_k``, the routed field, the unit states),
and evaluates the competitors of all of them in one call of the experts: at the gate's last micro-batch, inside the
model's forward, or earlier where the kept rows reach the layer's share of the free memory (:func:`pool_budget`).
The distances, the jump and their per-window sums are then computed per micro-batch as before.

The pooled call is a grouped product of its own rows (``adapters/grouped_experts.pair_fields``), so its bits are those
of the experts' own call of those rows; they differ from a call per micro-batch within the products' rounding.

Example (a pool that holds nothing evaluates nothing):
    >>> pool = CompetitorPool(budget=1 << 20)
    >>> pool.flush(lambda pairs: [], acc=None, eps_d=1e-6), pool.nbytes
    (None, 0)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from atlas_tracking.receipts.field_chunk import adjacent_receipts, random_distance

POOL_SHARE = 0.1
"""The share of the memory free when a gate starts that every layer's kept competitor rows may take together."""

Pairs = list[tuple[torch.Tensor, torch.Tensor]]


def pool_budget(free: int | None, layers: int) -> int | None:
    """Bytes one layer's pool may hold: its share of :data:`POOL_SHARE` of ``free`` bytes over ``layers`` routed
    layers; None (pool nothing) where the free memory is unknown.

    >>> pool_budget(10 << 30, 8), pool_budget(None, 8)
    (134217728, None)
    """
    return None if free is None else int(free * POOL_SHARE) // max(1, layers)


@dataclass
class PendingBatch:
    """One kept micro-batch's competitors, waiting for the pooled call, and what their receipts read."""

    rows: slice
    """The micro-batch's canary windows."""
    window: int
    """Tokens a window."""
    adjacent: tuple[torch.Tensor, torch.Tensor]
    """The adjacent competitor's pairs: every token's row ``[n, d]`` and ``e_k1`` ``[n, 1]``."""
    random: tuple[torch.Tensor, torch.Tensor]
    """The random competitor's pairs at the boundary candidates: rows ``[M, d]`` and experts ``[M, 1]``."""
    zh: torch.Tensor
    """``[n, d]`` the unit states."""
    v_k: torch.Tensor
    """``[n, d]`` the tangent field of ``e_k``."""
    field: torch.Tensor
    """``[n, d]`` the routed tangent field."""
    rho_k: torch.Tensor
    """``[n]`` the renormalised weight of ``e_k``."""
    b_pos: torch.Tensor
    """``[M]`` the boundary candidates' positions."""
    boundary: torch.Tensor
    """``[n]`` boundary tokens whose ``e_k`` and ``e_k1`` both carry a field (``d_adjacent_boundary``, the jump)."""
    interior: torch.Tensor
    """``[n]`` the same off the boundary (``d_adjacent_interior``)."""
    rand_ok: torch.Tensor
    """``[M]`` candidates in the boundary set whose random competitor and ``e_k`` both carry a field."""

    @property
    def nbytes(self) -> int:
        """Bytes this batch keeps alive (its rows included)."""
        tensors = (*self.adjacent, *self.random, self.zh, self.v_k, self.field, self.rho_k, self.b_pos,
                   self.boundary, self.interior, self.rand_ok)
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class CompetitorPool:
    """A layer's pending micro-batches within ``budget`` bytes (None: pool nothing)."""

    budget: int | None
    pending: list[PendingBatch] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(batch.nbytes for batch in self.pending)

    def add(self, batch: PendingBatch) -> None:
        self.pending.append(batch)

    def full(self) -> bool:
        """Whether the pending batches reached the budget (evaluate them now)."""
        return self.budget is not None and self.nbytes >= self.budget

    def flush(self, evaluate: Callable[[Pairs], list[torch.Tensor]], acc: Any, eps_d: float) -> None:
        """Evaluate every pending batch's competitors in one call (``evaluate``: their raw outputs ``[R, 1, d]`` per
        group of pairs) and add their distances and jumps to the layer's per-window sums and arrays (``acc``, a
        ``LayerAccumulator``), as a micro-batch with its competitors' fields adds them."""
        if not self.pending:
            return
        fields = evaluate([pair for batch in self.pending for pair in (batch.adjacent, batch.random)])
        names = acc.sum_names
        adj_b, adj_i, rand = (names.index(f"{name}.sum") for name in
                              ("d_adjacent_boundary", "d_adjacent_interior", "d_random_boundary"))
        for i, batch in enumerate(self.pending):
            u_adj, u_rand = fields[2 * i], fields[2 * i + 1]
            d_adj, jump = adjacent_receipts(u_adj[:, 0], batch.zh, batch.v_k, batch.field, batch.rho_k, eps_d)
            d_rand = random_distance(u_rand[:, 0], batch.zh, batch.v_k, batch.b_pos, eps_d)
            windows = batch.rows.stop - batch.rows.start
            acc.sums[adj_b, batch.rows] += torch.where(batch.boundary, d_adj, 0.0).view(windows, -1).sum(-1)
            acc.sums[adj_i, batch.rows] += torch.where(batch.interior, d_adj, 0.0).view(windows, -1).sum(-1)
            acc.sums[rand, batch.rows] += torch.where(batch.rand_ok, d_rand, 0.0).view(windows, -1).sum(-1)
            acc.arrays["jump"][batch.rows] = torch.where(batch.boundary, jump, float("nan")).view(windows, batch.window)
        self.pending.clear()
