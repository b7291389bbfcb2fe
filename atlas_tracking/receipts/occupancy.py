"""Occupancy of the atlas: expert loads, dead experts, load CV, router entropy, cells (docs/receipts.md#occupancy).

Device-side functions count; host-side functions (numpy) turn counts into receipts.

Example:
    >>> import numpy as np
    >>> occ = occupancy_from_loads(np.array([2, 2, 0, 0]), n_tokens=2, p_mass=np.array([0.9, 0.9, 0.1, 0.1]), beta_pi=1e3)
    >>> occ["dead_experts"], occ["experts_active"], occ["load_cv"], round(occ["router_entropy"], 4)
    (2, 2, 1.0, 0.6931)
    >>> cell_stats(np.array([3, 1]))["cells_visited"]
    2
"""

from __future__ import annotations

import math

import numpy as np
import torch

from atlas_tracking.receipts.load import load_cv


def window_loads(active: torch.Tensor, n_windows: int, n_experts: int) -> torch.Tensor:
    """``[n_windows, E]`` counts of tokens that routed to each expert, per window (int64, on device), from the
    window-major active sets ``[n_windows * T, k]`` (each window's ``T`` tokens in a row).

    >>> window_loads(torch.tensor([[0, 1], [1, 2], [2, 3], [2, 0]]), n_windows=2, n_experts=4).tolist()
    [[1, 2, 1, 0], [1, 0, 2, 1]]
    """
    index = active.reshape(n_windows, -1)
    counts = torch.zeros(n_windows, n_experts, dtype=torch.int64, device=active.device)
    return counts.scatter_add_(1, index, index.new_ones(()).expand_as(index))


def smin(values: np.ndarray, beta: float) -> float:
    """Soft minimum ``-1/beta log sum exp(-beta a_i)`` (the report's eq. 18), computed stably."""
    a = -beta * np.asarray(values, dtype=np.float64)
    m = a.max()
    return float(-(m + math.log(np.exp(a - m).sum())) / beta)


def smax(values: np.ndarray, beta: float) -> float:
    """Soft maximum ``1/beta log sum exp(beta a_i)`` (the report's eq. 19)."""
    return -smin(-np.asarray(values, dtype=np.float64), beta)


def occupancy_from_loads(
    loads: np.ndarray, n_tokens: int, p_mass: np.ndarray, beta_pi: float
) -> dict[str, float | int]:
    """Occupancy receipts from total expert loads over ``n_tokens`` canary tokens.

    ``loads[e] = #{t : e in R_t}``; ``p_mass[e] = sum_t p_t,e`` (full routing distribution).
    ``pi_sum`` is ``sum_e pi_e``, which equals k: a built-in consistency check.
    """
    loads = np.asarray(loads, dtype=np.float64)
    n_experts = loads.shape[0]
    pi = loads / n_tokens
    dead = int((loads == 0).sum())
    total = loads.sum()
    f = loads / total if total > 0 else np.zeros_like(loads)
    nz = f[f > 0]
    return {
        "dead_experts": dead,
        "experts_active": n_experts - dead,
        "load_cv": load_cv(loads),
        "router_entropy": float(-(nz * np.log(nz)).sum()),
        "pi_min": float(pi.min()),
        "pi_sum": float(pi.sum()),
        "pi_tail_smooth": smin(np.asarray(p_mass, dtype=np.float64) / n_tokens, beta_pi),
    }


def cell_stats(cell_counts: np.ndarray) -> dict[str, float | int]:
    """Active-set cells: number visited and the entropy (nats) of the cell distribution mu(S)."""
    c = np.asarray(cell_counts, dtype=np.float64)
    c = c[c > 0]
    if c.size == 0:
        return {"cells_visited": 0, "cell_entropy": 0.0}
    mu = c / c.sum()
    return {"cells_visited": int(c.size), "cell_entropy": float(-(mu * np.log(mu)).sum())}


def cell_keys(active: torch.Tensor, n_experts: int) -> torch.Tensor:
    """One exact key per token for its active set: ``sum_j sorted_j E^j`` (int64) when ``E^k < 2^62``,
    else the sorted rows themselves. Equal keys <=> equal sets."""
    rows = torch.sort(active, dim=1).values
    if n_experts ** active.shape[1] >= 2**62:
        return rows
    powers = n_experts ** torch.arange(active.shape[1], device=active.device, dtype=torch.int64)
    return (rows * powers).sum(dim=1)


def sorted_cell_keys(keys: torch.Tensor) -> torch.Tensor:
    """Active-set keys (:func:`cell_keys`) in order, on their device: integer keys ascending, rows lexicographically
    (stable sorts from the last column to the first), so that the host counts the cells in one pass over them.

    >>> sorted_cell_keys(torch.tensor([7, 3, 7])).tolist()
    [3, 7, 7]
    >>> sorted_cell_keys(torch.tensor([[1, 5], [0, 9], [1, 2]])).tolist()
    [[0, 9], [1, 2], [1, 5]]
    """
    if keys.ndim == 1:
        return torch.sort(keys).values
    order = torch.arange(len(keys), device=keys.device)
    for column in range(keys.shape[1] - 1, -1, -1):
        order = order.index_select(0, torch.sort(keys[:, column].index_select(0, order), stable=True).indices)
    return keys.index_select(0, order)


def count_cells(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct active-set keys and how many tokens visited each, from every token's key in order
    (:func:`sorted_cell_keys`, read back to the host): the runs of equal keys (counted on the host: on the device the
    number of distinct keys would be a host synchronisation of its own).

    >>> keys, counts = count_cells(np.array([3, 7, 7]))
    >>> keys.tolist(), counts.tolist()
    ([3, 7], [1, 2])
    >>> keys, counts = count_cells(np.array([[0, 9], [1, 2], [1, 2]]))
    >>> keys.tolist(), counts.tolist()
    ([[0, 9], [1, 2]], [1, 2])
    """
    if len(keys) == 0:
        return keys[:0], np.zeros(0, dtype=np.int64)
    differs = keys[1:] != keys[:-1]
    starts = np.flatnonzero(np.concatenate([[True], differs if keys.ndim == 1 else differs.any(axis=1)]))
    return keys[starts], np.diff(np.append(starts, len(keys))).astype(np.int64)
