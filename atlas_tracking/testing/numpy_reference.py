"""Plain numpy loops the tests hold the receipts to (docs/receipts.md), written from the definitions, not the code.

>>> import numpy as np
>>> v = np.array([[[1.0, 0.0], [1.0, 0.0]]])
>>> c2_loop(v, None, np.array([[0.5, 0.5]]), np.zeros((1, 2)), beta=1.0, eps=0.0)
[1.0]
"""

from __future__ import annotations

import math

import numpy as np


def c2_loop(u: np.ndarray, zh: np.ndarray | None, rho: np.ndarray, s: np.ndarray, beta: float, eps: float,
            carries: np.ndarray | None = None) -> list[float | None]:
    """Per-token C2 (docs/receipts.md#state2-co-active-overlap-compatibility) over the ordered pairs of the active
    experts that carry a field (``carries [N, k]``; all of them when None): ``sum w kappa / sum w`` with
    ``w = rho_a rho_b exp(-beta |s_a - s_b|)``. ``u [N, k, d]`` are raw fields projected at ``zh [N, d]``
    (None: ``u`` is already tangent). A token with fewer than two field-carrying experts gives None."""
    out: list[float | None] = []
    for t in range(u.shape[0]):
        keep = [m for m in range(u.shape[1]) if carries is None or carries[t, m]]
        if len(keep) < 2:
            out.append(None)
            continue
        v = {m: u[t, m] if zh is None else u[t, m] - float(np.dot(u[t, m], zh[t])) * zh[t] for m in keep}
        num = den = 0.0
        for a in keep:
            for b in keep:
                if a != b:
                    w = rho[t, a] * rho[t, b] * math.exp(-beta * abs(s[t, a] - s[t, b]))
                    num += w * float(np.dot(v[a], v[b])) / (np.linalg.norm(v[a]) * np.linalg.norm(v[b]) + eps)
                    den += w
        out.append(float(num / den))
    return out


def near_tie_loop(scores: np.ndarray, active: np.ndarray, eps: list[float]) -> list[list[bool] | None]:
    """Per token, whether its set margin lies within each rounding ``eps`` of a tie (docs/receipts.md#near-tie-mass),
    or None when it has no eligible competitor. ``scores [N, E]`` are the selection scores (``-inf``: ineligible),
    ``active [N, k]`` the model's choice; the arithmetic is float32, as the gate's:
    ``|s_k - s_k1| <= eps (|s_k| + |s_k1|)`` with ``s_k`` the lowest selected score and ``s_k1`` the best eligible
    score outside the active set (an ineligible selected expert, ``s_k = -inf``, is never a near tie).

    >>> near_tie_loop(np.array([[1.0, 0.995, 0.0], [2.0, -np.inf, -np.inf]]), np.array([[0], [0]]), [2**-7, 2**-10])
    [[True, False], None]
    """
    out: list[list[bool] | None] = []
    for t in range(scores.shape[0]):
        chosen = set(active[t].tolist())
        s_k = min(np.float32(scores[t, e]) for e in chosen)
        rest = [np.float32(scores[t, e]) for e in range(scores.shape[1]) if e not in chosen and np.isfinite(scores[t, e])]
        if not rest:
            out.append(None)
            continue
        s_k1 = max(rest)
        size, scale = abs(s_k - s_k1), abs(s_k) + abs(s_k1)
        out.append([bool(np.isfinite(size) and size <= np.float32(e) * scale) for e in eps])  # an ineligible s_k: no tie
    return out


def coupling_loop(x: np.ndarray, active: np.ndarray, weight: np.ndarray, gamma: np.ndarray, layernorm: bool,
                  fields: np.ndarray, carries: np.ndarray) -> dict[str, list]:
    """Router-expert coupling of one layer (docs/receipts.md#router-expert-coupling), token by token and expert by
    expert in float64: the state-space rows ``Gamma w_e`` (centred for a LayerNorm), each expert's mean angular state
    and mean tangent field over its routed tokens (``fields [N, k, d]`` raw outputs, projected here; slots
    ``carries [N, k]`` False carry none), and the alignment ``cos(row, mean state)`` (None for a dead expert).

    >>> out = coupling_loop(np.array([[1.0, 0.0], [0.0, 2.0]]), np.array([[0], [0]]), np.array([[1.0, 1.0]]),
    ...                     np.ones(2), False, np.zeros((2, 1, 2)), np.ones((2, 1), bool))
    >>> [round(a, 6) for a in out["alignment"]]
    [1.0]
    """
    n_experts, d = weight.shape
    rows, states, field_means, align = [], [], [], []
    for e in range(n_experts):
        row = [float(weight[e, j]) * float(gamma[j]) for j in range(d)]
        if layernorm:
            mean = sum(row) / d
            row = [v - mean for v in row]
        s_sum, f_sum, count, f_count = [0.0] * d, [0.0] * d, 0, 0
        for t in range(len(x)):
            xt = [float(v) for v in x[t]]
            if layernorm:
                mu = sum(xt) / d
                xt = [v - mu for v in xt]
            norm = math.sqrt(sum(v * v for v in xt))
            zh = [v / norm if norm > 0 else 0.0 for v in xt]  # a zero state stays zero (receipts/geometry.py)
            for slot, expert in enumerate(active[t]):
                if expert != e:
                    continue
                count += 1
                s_sum = [a + b for a, b in zip(s_sum, zh)]
                if carries[t, slot]:
                    u = [float(v) for v in fields[t, slot]]
                    radial = sum(a * b for a, b in zip(u, zh))
                    f_sum = [a + b - radial * c for a, b, c in zip(f_sum, u, zh)]
                    f_count += 1
        state = [v / count for v in s_sum] if count else [math.nan] * d
        field = [v / count for v in f_sum] if f_count else [math.nan] * d
        rows.append(row)
        states.append(state)
        field_means.append(field)
        if count:
            dot = sum(a * b for a, b in zip(row, state))
            align.append(dot / (math.sqrt(sum(v * v for v in row)) * math.sqrt(sum(v * v for v in state))))
        else:
            align.append(None)
    return {"rows": rows, "state": states, "field": field_means, "alignment": align}


def comove_loop(now: dict[str, list], base: dict[str, list], part: str) -> list[float | None]:
    """Per expert, ``cos(row - row0, part - part0)`` for ``part`` "state" or "field" (None where either change is 0 or
    the part is absent on either side: docs/receipts.md#co-movement)."""
    out: list[float | None] = []
    for r1, r0, p1, p0 in zip(now["rows"], base["rows"], now[part], base[part]):
        dr = [a - b for a, b in zip(r1, r0)]
        dp = [a - b for a, b in zip(p1, p0)]
        rr, pp = sum(v * v for v in dr), sum(v * v for v in dp)
        if any(math.isnan(v) for v in dp) or rr == 0 or pp == 0:
            out.append(None)
        else:
            out.append(sum(a * b for a, b in zip(dr, dp)) / math.sqrt(rr * pp))
    return out
