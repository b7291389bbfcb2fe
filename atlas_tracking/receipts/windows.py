"""Receipts from per-window arrays: the one reduction used by ``measure`` and by ``verify``.

Every number a gate reports (except the exact margin quantiles, which need per-token values)
is recomputed here from the per-window sums and counts stored in the artifact, so a verifier
can re-derive every value, CI and pass/fail from the JSON alone.

Example:
    >>> import numpy as np
    >>> w = {"c2": {"sum": [0.5, 0.1], "count": [1, 1]}}
    >>> vals, cis = ratio_receipts(w, bootstrap_indices(2, 50, 0), 0.95)
    >>> round(vals["c2"], 3)
    0.3
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from atlas_tracking.receipts.coupling import alignment_receipts_of
from atlas_tracking.receipts.occupancy import cell_stats, occupancy_from_loads
from atlas_tracking.receipts.state1 import NEAR_TIE_DTYPES
from atlas_tracking.receipts.stats import (
    bootstrap_indices,
    float_multiplicity,
    percentile_ci,
    percentile_cis,
    pooled_ratios,
    ratio_sample_matrix,
)

RATIO_RECEIPTS: tuple[str, ...] = (
    "margin_mean",
    "c2",
    "ov_cf",
    "d_adjacent_boundary",
    "d_adjacent_interior",
    "d_random_boundary",
)
"""Receipts that are pooled means: ``sum(sum_w) / sum(count_w)``, each with a window-bootstrap CI."""

RANGES: dict[str, tuple[float, float]] = {
    "c2": (-1.0, 1.0),
    "ov_cf": (0.0, 1.0),
    "d_adjacent_boundary": (0.0, 1.0),
    "d_adjacent_interior": (0.0, 1.0),
    "d_random_boundary": (0.0, 1.0),
}
"""The range of each pooled receipt that is a cosine, an overlap or a redundancy distance, per token and so per
window and per layer; ``verify`` fails an artifact whose value leaves it."""

COUNTERS: tuple[str, ...] = (
    "excluded_tokens", "rank_violations", "nonfinite_logits", "no_random_competitor", "dropped_routes",
    "zero_expert_pairs",
)
"""Per-window counts reported as layer totals: tokens with no eligible competitor (out of State1 and V2), model
choices that are not a top-k of the selection scores, tokens with non-finite router logits, boundary tokens
with no eligible expert left for the random competitor (out of ``d_random_boundary`` and so of V2 C2),
capacity-dropped routes, and V2 pairs with a zero-computation expert on either side (out of V2 and
``transition_incompat``)."""

V2_AXES: dict[str, tuple[str, str]] = {
    "v2_c1": ("d_adjacent_boundary", "d_adjacent_interior"),
    "v2_c2": ("d_adjacent_boundary", "d_random_boundary"),
}
"""V2 axes as differences of two pooled means (docs/receipts.md#v2-axes): C1 = Delta BI, C2 = Delta Brand."""

__all__ = [
    "COUNTERS",
    "RATIO_RECEIPTS",
    "TOP1",
    "V2_AXES",
    "bootstrap_indices",
    "c2_absent",
    "layers_receipts",
    "median_receipt",
    "near_tie_tokens",
    "ratio_receipts",
    "summary",
]


def _f(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else float(x)


def ratio_receipts(per_window: dict[str, Any], idx: np.ndarray, level: float,
                   axes: dict[str, tuple[str, str]] | None = None) -> tuple[dict, dict]:
    """Pooled ratio receipts and their CIs for every ``{name: {"sum", "count"}}`` entry present, and the boundary
    mass at each delta (``boundary_mass@delta``), resampled together; with ``axes`` (``{axis: (a, b)}``, as
    :data:`V2_AXES`) also each difference ``a - b``, its CI from the same resamples (paired) and ``axis_pass``
    (the CI's upper end below 0), None where either side is absent.

    >>> w = {"a": {"sum": [0.2, 0.1], "count": [1, 1]}, "b": {"sum": [0.5, 0.7], "count": [1, 1]}}
    >>> vals, cis = ratio_receipts(w, bootstrap_indices(2, 50, 0), 0.95, {"gap": ("a", "b")})
    >>> round(vals["gap"], 3), vals["gap_pass"]
    (-0.45, True)
    """
    return ratio_receipts_of([(per_window, axes)], idx, level)[0]


def _ratio_entries(per_window: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``{name: {"sum", "count"}}`` entries of a per-window dict, with its boundary masses (``boundary_mass@delta``)."""
    entries = {name: entry for name, entry in per_window.items() if isinstance(entry, dict) and "sum" in entry}
    entries.update({f"boundary_mass@{name}": entry for name, entry in per_window.get("boundary_mass", {}).items()})
    return entries


def ratio_receipts_of(groups: list[tuple[dict[str, Any], dict[str, tuple[str, str]] | None]], idx: np.ndarray,
                      level: float) -> list[tuple[dict, dict]]:
    """:func:`ratio_receipts` of each ``(per_window, axes)`` of ``groups`` (every layer's receipts and near-tie shares
    of a gate), all their entries resampled in one product and every CI taken in one quantile call.

    >>> idx = bootstrap_indices(2, 50, 0)
    >>> w = {"a": {"sum": [0.2, 0.1], "count": [1, 1]}, "b": {"sum": [0.5, 0.7], "count": [1, 1]}}
    >>> one, two = ratio_receipts_of([(w, {"gap": ("a", "b")}), ({"c": w["b"]}, None)], idx, 0.95)
    >>> one == ratio_receipts(w, idx, 0.95, {"gap": ("a", "b")}), two == ratio_receipts({"c": w["b"]}, idx, 0.95)
    (True, True)
    """
    named = [_ratio_entries(per_window) for per_window, _ in groups]
    flat = [entry for entries in named for entry in entries.values()]
    pooled: list[float] = []
    samples = np.zeros((len(idx), 0))
    if flat:
        sums = np.array([np.asarray(e["sum"], dtype=np.float64) for e in flat])
        counts = np.array([np.asarray(e["count"], dtype=np.float64) for e in flat])
        pooled = pooled_ratios(sums, counts).tolist()
        samples = ratio_sample_matrix(sums, counts, idx)
    paired: list[np.ndarray] = []  # the axes' paired differences, as columns after the entries'
    parts = []
    start = 0
    for (_, axes), entries in zip(groups, named):
        column = {name: start + j for j, name in enumerate(entries)}
        values: dict[str, Any] = {name: _f(pooled[j]) for name, j in column.items()}
        axis_column = {}
        for axis, (a, b) in (axes or {}).items():
            if values.get(a) is not None and values.get(b) is not None:
                axis_column[axis] = len(flat) + len(paired)
                paired.append(samples[:, column[a]] - samples[:, column[b]])
        parts.append((axes or {}, column, values, axis_column))
        start += len(entries)
    bounds = percentile_cis(np.column_stack([samples, *paired]), level).tolist() if flat else []
    out = []
    for axes, column, values, axis_column in parts:
        cis: dict[str, Any] = {name: [_f(lo), _f(hi)] for name, (lo, hi) in ((n, bounds[j]) for n, j in column.items())}
        for axis, (a, b) in axes.items():
            lo, hi = bounds[axis_column[axis]] if axis in axis_column else (math.nan, math.nan)
            values[axis] = _f(values[a] - values[b]) if axis in axis_column else None
            cis[axis] = [_f(lo), _f(hi)]
            values[axis + "_pass"] = bool(hi < 0) if math.isfinite(hi) else None
        out.append((values, cis))
    return out


def _weighted_positions(window_of: np.ndarray, mult: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each resample (row of ``mult``), the lower and upper middle sorted positions: the first whose cumulative
    weight ``c`` has ``2 c >= total`` and ``2 c >= total + 1``, where value i weighs ``mult[b, window_of[i]]``
    (whole-number multiplicities); and the totals.

    Exact, in two passes that keep the working set to ``O(B sqrt(n) + W sqrt(n))``: cumulative weights at
    block ends (one matrix product) find each resample's block, then one block is scanned per resample and
    middle position. Resamples run along the last axis, so each pass is a few whole-array operations.
    """
    n, (n_boot, n_win) = len(window_of), mult.shape
    blk = max(1, math.isqrt(n))
    n_blocks = -(-n // blk)
    per_block = np.bincount(np.arange(n) // blk * n_win + window_of, minlength=n_blocks * n_win)
    counts_to_end = np.cumsum(per_block.reshape(n_blocks, n_win), axis=0).astype(np.float64)
    cum_end = np.zeros((n_blocks + 1, n_boot))  # weight before each block and in all: [1 + blocks, B], exact integers
    np.matmul(counts_to_end, mult.T, out=cum_end[1:])
    total = cum_end[-1]
    targets = np.stack([total, total + 1.0])[:, None, :]  # [2, 1, B]: the lower and the upper middle
    block = np.minimum((2 * cum_end[1:] < targets).sum(axis=1), n_blocks - 1)  # [2, B]
    resample = np.arange(n_boot)
    before = cum_end.ravel().take(block * n_boot + resample)
    padded = np.append(window_of, np.full(n_blocks * blk - n, n_win))  # past the last value: a window of weight 0
    weight_of = np.append(mult.T.ravel(), np.zeros(n_boot))  # [(W + 1) B], window-major
    scanned = padded.take(block[:, None, :] * blk + np.arange(blk)[:, None])  # [2, blk, B]: windows of the block
    cum = before[:, None, :] + np.cumsum(weight_of.take(scanned * n_boot + resample), axis=1)
    pos = np.minimum(block * blk + (2 * cum < targets).sum(axis=1), n - 1)  # in range where total is 0
    return pos[0], pos[1], total


def median_receipt(per_window_values: list[list[float]], idx: np.ndarray, level: float) -> tuple[float, list]:
    """Median of values pooled over windows (the mean of the two middle order statistics when the count
    is even), with a window-bootstrap percentile CI.

    A resample weights each value by how often its window was drawn; its median is the same usual median
    of the resampled values, taken from the two middle positions of the cumulative weight.

    >>> import numpy as np
    >>> median_receipt([[0.4, 0.1], [0.3, 0.2]], bootstrap_indices(2, 20, 0), 0.95)[0]
    0.25
    """
    est, samples = median_samples(per_window_values, idx)
    return est, [_f(v) for v in percentile_ci(samples, level)]


def median_samples(per_window_values: list[list[float]], idx: np.ndarray) -> tuple[float, np.ndarray]:
    """:func:`median_receipt`'s estimate and its ``[resamples]`` bootstrap medians (NaN where a resample holds no
    value; all NaN when no window holds one)."""
    lengths = [len(v) for v in per_window_values]
    flat = np.concatenate([np.asarray(v, dtype=np.float64) for v in per_window_values]) if sum(lengths) else np.zeros(0)
    if flat.size == 0:
        return math.nan, np.full(len(idx), math.nan)
    window_of = np.repeat(np.arange(len(per_window_values)), lengths)
    order = np.argsort(flat, kind="stable")
    flat, window_of = flat[order], window_of[order]
    mult = float_multiplicity(idx, len(per_window_values))
    lower, upper, total = _weighted_positions(window_of, mult)
    return float(np.median(flat)), np.where(total > 0, 0.5 * (flat[lower] + flat[upper]), np.nan)


def layers_receipts(per_window: list[dict[str, Any]], cell_counts: list[Any], n_tokens: int, beta_pi: float,
                    idx: np.ndarray, level: float) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """All per-window-derived receipts of each layer of a gate (its ``per_window`` dict and ``cell_counts``):
    occupancy, ratios, boundary mass, near-tie shares, the transition median, alignment and the V2 axes, with their
    CIs. The layers' resamples are taken together (one product for the ratio receipts, one for the alignments) and
    every CI of a kind in one quantile call: the values of one layer at a time (docs/receipts.md#statistics).

    >>> idx = bootstrap_indices(2, 50, 0)
    >>> pw = {"c2": {"sum": [0.5, 0.1], "count": [1, 1]}, "load": [[1, 1], [2, 0]], "p_mass_total": [2.0, 1.0],
    ...       "transition_jump": [[0.2], [0.4, 0.1]]}
    >>> (values, cis), = layers_receipts([pw], [[3]], 3, 1.0, idx, 0.95)
    >>> round(values["c2"], 3), values["dead_experts"], values["transition_incompat"]
    (0.3, 0, 0.2)
    """
    groups: list[tuple[dict[str, Any], dict[str, tuple[str, str]] | None]] = []
    for pw in per_window:
        groups += [(pw, V2_AXES), *([(pw["near_tie"], None)] if "near_tie" in pw else [])]
    ratios = iter(ratio_receipts_of(groups, idx, level))
    aligned = [i for i, pw in enumerate(per_window) if "alignment" in pw and "absent" not in pw["alignment"]]
    alignments = dict(zip(aligned, alignment_receipts_of([per_window[i]["alignment"] for i in aligned],
                                                         [per_window[i]["load"] for i in aligned], idx, level)))
    jumps = [i for i, pw in enumerate(per_window) if "transition_jump" in pw]
    medians = [median_samples(per_window[i]["transition_jump"], idx) for i in jumps]
    bounds = percentile_cis(np.column_stack([samples for _, samples in medians]), level).tolist() if medians else []
    transition = {i: (est, ci) for i, (est, _), ci in zip(jumps, medians, bounds)}  # each layer's median and CI
    out = []
    for i, (pw, cells) in enumerate(zip(per_window, cell_counts)):
        values, cis = next(ratios)
        v2 = ({k: values.pop(k) for axis in V2_AXES for k in (axis, axis + "_pass")},
              {axis: cis.pop(axis) for axis in V2_AXES})  # the V2 axes come last in a layer's receipts
        if "near_tie" in pw:
            values["near_tie"], cis["near_tie"] = next(ratios)
            values["near_tie_tokens"] = near_tie_tokens(pw["near_tie"])
        loads = np.asarray(pw["load"], dtype=np.int64)
        p_mass = np.asarray(pw["p_mass_total"], dtype=np.float64)
        values.update(occupancy_from_loads(loads.sum(axis=0), n_tokens, p_mass, beta_pi))
        values.update(cell_stats(np.asarray(cells, dtype=np.int64)))
        if i in transition:
            est, ci = transition[i]
            values["transition_incompat"], cis["transition_incompat"] = _f(est), [_f(v) for v in ci]
        for key in COUNTERS:
            if key in pw:
                values[key] = int(np.sum(pw[key]))
        if "absent" in pw.get("alignment", {}):
            values["alignment_absent"] = pw["alignment"]["absent"]
        elif i in alignments:
            values.update(alignments[i][0])
            cis.update(alignments[i][1])
        values.update(v2[0])
        cis.update(v2[1])
        out.append((values, cis))
    return out


def near_tie_tokens(near_tie: dict[str, Any]) -> dict[str, int]:
    """The counts behind a layer's near-tie shares (docs/receipts.md#near-tie-mass): its near-tie tokens at each
    precision and its ``counted`` tokens (those with an eligible competitor), summed over the windows.

    >>> near_tie_tokens({"bf16": {"sum": [2, 1], "count": [16, 15]}, "fp16": {"sum": [0, 1], "count": [16, 15]}})
    {'bf16': 3, 'fp16': 1, 'counted': 31}
    """
    tokens = {name: int(np.sum(entry["sum"])) for name, entry in near_tie.items()}
    counted = {int(np.sum(entry["count"])) for entry in near_tie.values()}
    if len(counted) != 1:
        raise ValueError(f"near-tie precisions count different tokens: {sorted(counted)}")
    return {**tokens, "counted": counted.pop()}


def _finite(vals: list) -> list[float]:
    return [v for v in vals if v is not None and math.isfinite(v)]


TOP1 = "top-1 routing"
"""Why C2 is absent when every routed layer selects one expert per token (docs/receipts.md#top-1-routing-and-zero-computation-experts)."""


def c2_absent(layers: list[dict[str, Any]]) -> str | None:
    """Why the cross-layer C2 is absent (None while some layer has one): :data:`TOP1` when every routed layer
    routes top-1, else no token of the canary had two field-carrying active experts.

    >>> c2_absent([{"top_k": 1, "receipts": {"c2": None}}])
    'top-1 routing'
    >>> c2_absent([{"top_k": 2, "receipts": {"c2": 0.1}}]) is None
    True
    """
    if any(_finite([layer["receipts"].get("c2")]) for layer in layers):
        return None
    if layers and all(layer.get("top_k") == 1 for layer in layers):
        return TOP1
    return "no canary token had two field-carrying active experts"


def summary(layers: list[dict[str, Any]], canary_nll: float | None) -> dict[str, Any]:
    """Cross-layer summaries (docs/receipts.md#summaries-across-layers): means, min entropy, max dead and CV, the
    mean and worst near-tie shares.

    ``mean_cv`` and ``max_cv`` are in the paper's unit (load CV x 100); ``c2_absent`` says why C2 is absent
    (:func:`c2_absent`), and is there only then.
    """
    def col(key: str) -> list[float]:
        return _finite([layer["receipts"].get(key) for layer in layers])

    def mean(key: str) -> float | None:
        v = col(key)
        return float(np.mean(v)) if v else None

    def near_tie(name: str, reduce: Callable[[list[float]], float]) -> float | None:
        v = _finite([(layer["receipts"].get("near_tie") or {}).get(name) for layer in layers])
        return float(reduce(v)) if v else None

    protected = [layer for layer in layers if layer.get("protected")]
    c2_prot = _finite([layer["receipts"].get("c2") for layer in protected])
    absent = c2_absent(layers)
    return {
        "n_layers": len(layers),
        "c2": mean("c2"),
        **({"c2_absent": absent} if absent else {}),
        "c2_min": min(col("c2")) if col("c2") else None,
        "c2_protected": float(np.mean(c2_prot)) if c2_prot else None,
        "dead_experts": mean("dead_experts"),
        "dead_experts_max": max(col("dead_experts")) if col("dead_experts") else None,
        "experts_active": mean("experts_active"),
        "min_entropy": min(col("router_entropy")) if col("router_entropy") else None,
        "mean_entropy": mean("router_entropy"),
        "mean_cv": 100.0 * mean("load_cv") if col("load_cv") else None,
        "max_cv": 100.0 * max(col("load_cv")) if col("load_cv") else None,
        "margin": mean("margin_mean"),
        **{f"near_tie_{name}{suffix}": near_tie(name, reduce)
           for name in NEAR_TIE_DTYPES for suffix, reduce in (("", np.mean), ("_max", max))},
        "ov_cf": mean("ov_cf"),
        "transition_incompat": mean("transition_incompat"),
        "alignment_median": mean("alignment_median"),
        "alignment_p10_min": min(col("alignment_p10")) if col("alignment_p10") else None,
        "alignment_negative": mean("alignment_negative"),
        "v2_c1_pass_layers": sum(1 for layer in layers if layer["receipts"].get("v2_c1_pass")),
        "v2_c2_pass_layers": sum(1 for layer in layers if layer["receipts"].get("v2_c2_pass")),
        "canary_nll": canary_nll,
        "num_experts": int(max(layer["num_experts"] for layer in layers)) if layers else None,
    }
