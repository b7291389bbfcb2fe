"""Router-expert coupling (docs/receipts.md#router-expert-coupling): whether each router row points at the tokens its
expert serves (alignment), and whether rows and tokens move together between a baseline and a gate (co-movement).

For one routed layer, with ``w_e`` the router's row of expert e in gate-input space and ``Gamma`` the pre-norm's gain:

- the row in state space is ``r_e = Gamma w_e`` (``logit_e = r_e . z + const``), centred for a LayerNorm (its ``z``
  is orthogonal to the all-ones vector, so that component of ``r_e`` is never seen);
- the mean angular state of expert e is ``m_e = mean_{t : e in R_t} zh_t``;
- alignment ``a_e = cos(r_e, m_e)``; per layer its median, lower decile and the share of experts with ``a_e < 0``;
- co-movement ``cos(r_e - r0_e, m_e - m0_e)`` against the baseline (and with ``f_e``, the expert's mean tangent field
  over its routed tokens, in place of ``m_e``).

The per-window arrays are ``dot[w, e] = sum over window w's tokens routed to e of r_e/||r_e|| . zh_t`` and the loads;
the expert's concentration ``||m_e||`` is kept once, so ``a_e = (sum_w dot / sum_w load) / ||m_e||``.

Example:
    >>> import numpy as np, torch
    >>> zh = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.6, 0.8]])
    >>> active = torch.tensor([[0], [1], [0], [1]])
    >>> rows = state_rows(torch.tensor([[2.0, 0.0], [-1.0, 0.0]]), torch.ones(2), layernorm=False)
    >>> dot, state_sum = window_sums(zh, active, unit_rows(rows), n_windows=2)
    >>> dot.abs().tolist()   # expert 1's row points away from its tokens: negative dots
    [[1.0, 0.0], [1.0, 0.6000000238418579]]
    >>> a = alignment(dot.numpy(), np.array([[1, 1], [1, 1]]), resultants(state_sum.numpy(), np.array([2, 2])))
    >>> [round(float(x), 4) for x in a]   # expert 0 serves the tokens it points at; expert 1 points away from its own
    [1.0, -0.3162]
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from atlas_tracking.receipts.geometry import angular
from atlas_tracking.receipts.stats import float_multiplicity, percentile_cis

LOWER_DECILE = 0.1
"""The quantile of a layer's expert alignments reported as its lower decile (``alignment_p10``)."""

COMOVE_PARTS = ("state", "field")
"""What a row's change is compared with: the change of its expert's mean angular state, and of its mean field."""


# --- on the device, inside a gate --------------------------------------------------------------------


def state_rows(weight: torch.Tensor, gamma: torch.Tensor, layernorm: bool) -> torch.Tensor:
    """``[E, d]`` the router rows in the state space of ``z``: ``Gamma w_e``, centred for a LayerNorm (fp32).

    >>> state_rows(torch.tensor([[1.0, 3.0]]), torch.tensor([2.0, 1.0]), layernorm=True).tolist()
    [[-0.5, 0.5]]
    """
    rows = weight.float() * gamma.float()
    return rows - rows.mean(-1, keepdim=True) if layernorm else rows


def unit_rows(rows: torch.Tensor) -> torch.Tensor:
    """Each row over its length (a zero row stays zero)."""
    return angular(rows)


def window_sums(zh: torch.Tensor, active: torch.Tensor, unit: torch.Tensor, n_windows: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """For window-major tokens (``zh [W L, d]``, active sets ``[W L, k]``) and unit rows ``[E, d]``: ``[W, E]`` the sum,
    over each window's tokens routed to e, of ``unit_e . zh_t``, and ``[E, d]`` the sum of those tokens' ``zh_t``.

    One batched product per micro-batch: each window's routing as a ``[E, L]`` count of routes (``W E L`` values, one
    per token and expert, no ``[tokens, k, d]`` tensor) times its ``[L, d]`` states, in float32, so that the order in
    which a token's experts sit in their slots does not enter; the windows' sums are then added in float64 and the
    dots are those sums' with the rows."""
    n, d = zh.shape
    length = n // n_windows
    routes = active.view(n_windows, length, -1).transpose(1, 2)  # [W, k, L] the expert of each slot
    member = zh.new_zeros(n_windows, len(unit), length, dtype=torch.float32)
    member.scatter_add_(1, routes, member.new_ones(1, 1, 1).expand(routes.shape))
    sums = torch.bmm(member, zh.float().view(n_windows, length, d)).double()
    return (sums * unit).sum(-1).float(), sums.sum(0)


def field_sum(v: torch.Tensor, experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``[E, d]`` the sum of the tangent fields ``v [N, k, d]`` each expert of ``experts [N, k]`` gave, accumulated in
    float64, so that the order in which a token's experts sit in their slots leaves the float32 means as they are
    (a zero-computation expert's row is left out where the means are formed).

    >>> field_sum(torch.ones(2, 2, 3), torch.tensor([[0, 1], [1, 2]]), 3)
    tensor([[1., 1., 1.],
            [2., 2., 2.],
            [1., 1., 1.]], dtype=torch.float64)
    """
    out = torch.zeros(n_experts, v.shape[-1], dtype=torch.float64, device=v.device)
    for slot in range(experts.shape[1]):  # one slot at a time: a float64 copy of [N, d], not of [N, k, d]
        out.index_add_(0, experts[:, slot], v[:, slot].double())
    return out


# --- on the host, from the artifact -------------------------------------------------------------------


def resultants(state_sum: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """``[E]`` each expert's concentration ``||m_e||`` (the length of its tokens' mean angular state, in [0, 1]); NaN
    for an expert no token reached."""
    norm = np.linalg.norm(np.asarray(state_sum, np.float64), axis=-1)
    loads = np.asarray(loads, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(loads > 0, norm / np.where(loads > 0, loads, 1.0), np.nan)


def alignment(dot: np.ndarray, load: np.ndarray, resultant: np.ndarray, row_norm: np.ndarray | None = None) -> np.ndarray:
    """``[E]`` the alignment of every expert from its per-window ``dot`` and ``load`` (``[W, E]``) and its
    concentration: ``(sum_w dot / sum_w load) / ||m_e||``; NaN for a dead expert, a zero row, or tokens whose mean
    state is 0."""
    return _alignment(np.asarray(dot, np.float64).sum(0), np.asarray(load, np.float64).sum(0), resultant, row_norm)


def _alignment(dot: np.ndarray, n: np.ndarray, resultant: Any, row_norm: Any) -> np.ndarray:
    res = np.asarray(resultant, np.float64)
    readable = np.isfinite(res) & (res > 0)  # per expert: a concentration to divide by, and a row
    if row_norm is not None:
        readable &= np.asarray(row_norm, np.float64) > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where((n > 0) & readable, dot / n / np.where(readable, res, 1.0), np.nan)


def _row_quantile(ordered: np.ndarray, count: np.ndarray, q: float) -> np.ndarray:
    """The ``q`` quantile (linear interpolation, numpy's default) of the first ``count`` values of each sorted row."""
    pos = q * np.maximum(count - 1, 0)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, np.maximum(count - 1, 0))
    rows = np.arange(len(ordered))
    low, high = ordered[rows, lo], ordered[rows, hi]
    return low + (pos - lo) * (high - low)


def _layer_stats(a: np.ndarray) -> np.ndarray:
    """``[R, 3]`` median, lower decile and negative share over the finite alignments of each row of ``a`` (NaN where a
    row has none); one sort of the whole matrix (NaN last), the quantiles read at their positions."""
    a = np.atleast_2d(a)
    count = np.isfinite(a).sum(-1)
    ordered = np.sort(a, axis=-1)  # a full sort: faster than partitioning at the four order statistics read
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.stack([_row_quantile(ordered, count, 0.5), _row_quantile(ordered, count, LOWER_DECILE),
                        (a < 0).sum(-1) / count], axis=-1)
    out[count == 0] = np.nan
    return out


def alignment_receipts(entry: dict[str, Any], load: Any, idx: np.ndarray, level: float) -> tuple[dict, dict]:
    """A layer's alignment receipts from its per-window ``entry`` (``dot [W, E]``, ``resultant [E]``, ``row_norm [E]``)
    and loads ``[W, E]``: every expert's ``alignment`` (None where it has none), ``alignment_median``,
    ``alignment_p10``, ``alignment_negative``, the dead experts named (``alignment_dead``), and window-bootstrap CIs
    of the three layer figures (a resample re-counts the windows' dots and loads; each expert's concentration is held
    at the canary's).

    >>> from atlas_tracking.receipts.stats import bootstrap_indices
    >>> entry = {"dot": [[0.5, -0.2, 0.0], [0.4, -0.1, 0.0]], "resultant": [0.9, 0.5, None], "row_norm": [1, 1, 1]}
    >>> vals, cis = alignment_receipts(entry, [[1, 1, 0], [1, 1, 0]], bootstrap_indices(2, 50, 0), 0.95)
    >>> [None if a is None else round(a, 6) for a in vals["alignment"]], vals["alignment_negative"], vals["alignment_dead"]
    ([0.5, -0.3, None], 0.5, [2])
    """
    return alignment_receipts_of([entry], [load], idx, level)[0]


_LAYER_FIGURES = ("alignment_median", "alignment_p10", "alignment_negative")
"""A layer's figures over its experts' alignments, each with a window-bootstrap CI."""


def alignment_receipts_of(entries: list[dict[str, Any]], loads: list[Any], idx: np.ndarray, level: float
                          ) -> list[tuple[dict, dict]]:
    """:func:`alignment_receipts` of several layers (their ``entries`` and ``loads``), every CI taken in one quantile
    call (each layer's resamples are formed on their own: a ``[resamples, experts]`` working set stays in cache).

    >>> from atlas_tracking.receipts.stats import bootstrap_indices
    >>> idx = bootstrap_indices(2, 50, 0)
    >>> one = {"dot": [[0.5, -0.2], [0.4, -0.1]], "resultant": [0.9, 0.5], "row_norm": [1, 1]}
    >>> two = {"dot": [[0.1, 0.2, 0.3]] * 2, "resultant": [0.3, 0.4, 0.5], "row_norm": [1, 1, 0]}
    >>> both = alignment_receipts_of([one, two], [[[1, 1]] * 2, [[1, 1, 1]] * 2], idx, 0.95)
    >>> both == [alignment_receipts(one, [[1, 1]] * 2, idx, 0.95), alignment_receipts(two, [[1, 1, 1]] * 2, idx, 0.95)]
    True
    """
    out, samples = [], []
    for entry, load in zip(entries, loads):
        dot, counts = np.asarray(entry["dot"], np.float64), np.asarray(load, np.float64)
        res = np.asarray([np.nan if r is None else r for r in entry["resultant"]], np.float64)
        row_norm = np.asarray(entry["row_norm"], np.float64)
        a = alignment(dot, counts, res, row_norm)
        n_experts = dot.shape[1]
        resampled = float_multiplicity(idx, len(dot)) @ np.concatenate([dot, counts], axis=1)  # one product for both
        samples.append(_layer_stats(_alignment(resampled[:, :n_experts], resampled[:, n_experts:], res, row_norm)))
        values: dict[str, Any] = {"alignment": [_f(x) for x in a]}
        values.update({name: _f(v) for name, v in zip(_LAYER_FIGURES, _layer_stats(a)[0])})
        values["alignment_dead"] = [int(e) for e in np.flatnonzero(counts.sum(0) == 0)]
        values["alignment_zero_rows"] = int((row_norm == 0).sum())
        out.append(values)
    bounds = (percentile_cis(np.concatenate(samples, axis=1), level).reshape(-1, len(_LAYER_FIGURES), 2) if samples
              else [])
    return [(values, {name: [_f(lo), _f(hi)] for name, (lo, hi) in zip(_LAYER_FIGURES, layer)})
            for values, layer in zip(out, bounds)]


def comovement_sums(now: dict[str, np.ndarray], base: dict[str, np.ndarray]) -> dict[str, list[float | None]]:
    """Per expert, the inner products co-movement reads, in float64, from the rows (``rows``), mean angular states
    (``state``) and mean fields (``field``) ``[E, d]`` of a gate and its baseline: ``router_sq = ||dr||^2`` and, for
    each part p of :data:`COMOVE_PARTS`, ``p_sq = ||dp||^2`` and ``p_dot = dr . dp`` (None where the part is absent
    on either side: a dead expert, a zero-computation expert's field).

    >>> rows0 = np.eye(2)
    >>> now = {"rows": rows0 + [[0.1, 0], [0, 0]], "state": np.array([[0.9, 0.1], [0, 1]]), "field": np.zeros((2, 2))}
    >>> base = {"rows": rows0, "state": np.array([[0.8, 0.1], [0, 1]]), "field": np.full((2, 2), np.nan)}
    >>> s = comovement_sums(now, base)
    >>> [round(x, 4) for x in s["router_sq"]], [round(x, 4) for x in s["state_dot"]], s["field_dot"]
    ([0.01, 0.0], [0.01, 0.0], [None, None])
    """
    dr = np.asarray(now["rows"], np.float64) - np.asarray(base["rows"], np.float64)
    out: dict[str, list[float | None]] = {"router_sq": [_f(x) for x in np.einsum("ed,ed->e", dr, dr)]}
    for part in COMOVE_PARTS:
        dp = np.asarray(now[part], np.float64) - np.asarray(base[part], np.float64)
        out[f"{part}_sq"] = [_f(x) for x in np.einsum("ed,ed->e", dp, dp)]
        out[f"{part}_dot"] = [_f(x) for x in np.einsum("ed,ed->e", dr, dp)]
    return out


def comovement_receipts(sums: dict[str, list[float | None]]) -> dict[str, Any]:
    """A layer's co-movement from :func:`comovement_sums`: for each part p, every expert's cosine ``comove_p_experts``
    (None where the router row or the part did not move, or the part is absent), the median ``comove_p`` and the share
    of compared experts that moved against their tokens, ``comove_p_against`` (cosine < 0); ``comove_router_still``
    counts the experts whose row did not move at all (a frozen router: every one), ``comove_p_still`` those whose
    part did not move. A cosine of zero vectors is never formed.

    >>> r = comovement_receipts({"router_sq": [0.0, 0.0], "state_sq": [0.0, 0.0], "state_dot": [0.0, 0.0],
    ...                          "field_sq": [0.0, None], "field_dot": [0.0, None]})
    >>> r["comove_state"], r["comove_router_still"], r["comove_state_still"], r["comove_state_compared"]
    (None, 2, 2, 0)
    """
    rr = np.asarray([np.nan if x is None else x for x in sums["router_sq"]], np.float64)
    out: dict[str, Any] = {"comove_router_still": int((rr == 0).sum())}
    for part in COMOVE_PARTS:
        pp = np.asarray([np.nan if x is None else x for x in sums[f"{part}_sq"]], np.float64)
        dot = np.asarray([np.nan if x is None else x for x in sums[f"{part}_dot"]], np.float64)
        ok = (rr > 0) & (pp > 0)
        with np.errstate(invalid="ignore", divide="ignore"):
            cos = np.where(ok, dot / np.sqrt(np.where(ok, rr * pp, 1.0)), np.nan)
        cos = np.clip(cos, -1.0, 1.0)
        compared = cos[np.isfinite(cos)]
        out[f"comove_{part}"] = _f(np.median(compared)) if compared.size else None
        out[f"comove_{part}_against"] = _f(np.mean(compared < 0)) if compared.size else None
        out[f"comove_{part}_compared"] = int(compared.size)
        out[f"comove_{part}_still"] = int((pp == 0).sum())
        out[f"comove_{part}_experts"] = [_f(x) for x in cos]
    return out


def _f(x: Any) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)
