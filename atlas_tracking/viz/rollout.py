"""The rollout agreement as the report shows it (docs/rollout.md): a run's ``rollout.jsonl`` read into per-layer
series over the recorded steps, one table row per routed layer, the first-mismatch-layer counts over every step and
the figure of mismatch (and bf16 near-tie mass) per layer over steps.

Example:
    >>> def row(layer, mismatched, fallback=0):
    ...     return {"layer": layer, "tokens": 10, "compared": 10 - fallback, "fallback": fallback,
    ...             "mismatched": mismatched, "mismatch": mismatched / (10 - fallback), "jaccard": 1 - mismatched / 20,
    ...             "near_tie": {"bf16": 0.2, "fp16": 0.0}}
    >>> lines = [{"step": 1, "first_mismatch": {"tokens": 10, "none": 8, "by_layer": {"0": 1, "2": 1}},
    ...           "layers": [row(0, 1), row(2, 2)]},
    ...          {"step": 2, "first_mismatch": {"tokens": 10, "none": 10, "by_layer": {"0": 0, "2": 0}},
    ...           "layers": [row(0, 0), row(2, 0, fallback=2)]}]
    >>> steps, series = rollout_series(lines, "mismatch")
    >>> steps, series
    ([1, 2], {0: [0.1, 0.0], 2: [0.2, 0.0]})
    >>> for r in layer_rows(lines):
    ...     print(r)
    ['layer 0', 0.05, 0.0, 0.975, 0.2, 0.0, '0 of 20']
    ['layer 2', 0.1, 0.0, 0.95, 0.2, 0.0, '2 of 20']
    >>> first_mismatch_rows(lines)
    [['layer 0', 1, 0.05], ['layer 2', 1, 0.05], ['none (every layer agrees)', 18, 0.9]]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from atlas_tracking.artifacts.rollout_summary import summarize
from atlas_tracking.receipts.state1 import NEAR_TIE_DTYPES

LAYER_HEADER = ["layer", "mismatch (mean over steps)", "mismatch (last step)", "jaccard (mean)",
                *[f"near-tie {name} (mean)" for name in NEAR_TIE_DTYPES], "fallback (positions)"]
"""The columns of :func:`layer_rows`."""


def _value(row: dict[str, Any], field: str) -> float:
    """``row[field]`` (``near_tie.bf16`` reads a nested field) as a float; NaN where it is None or absent."""
    value: Any = row
    for part in field.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return np.nan if value is None else float(value)


def rollout_series(lines: list[dict[str, Any]], field: str) -> tuple[list[int], dict[int, list[float]]]:
    """The recorded steps and, per routed layer (the model's layer number), ``field`` of each of its rows
    (``mismatch``, ``jaccard``, ``near_tie.bf16``, ...) at each step; NaN where the layer is absent or the field
    None (a layer that compared no position)."""
    steps = [int(line["step"]) for line in lines]
    series: dict[int, list[float]] = {}
    for i, line in enumerate(lines):
        for row in line["layers"]:
            series.setdefault(int(row["layer"]), [np.nan] * len(lines))[i] = _value(row, field)
    return steps, dict(sorted(series.items()))


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if np.isfinite(v)]
    return round(float(np.mean(finite)), 6) if finite else None


def _last(values: list[float]) -> float | None:
    return None if not values or not np.isfinite(values[-1]) else values[-1]


def layer_rows(lines: list[dict[str, Any]]) -> list[list[Any]]:
    """Per routed layer (:data:`LAYER_HEADER`): its mismatch averaged over the recorded steps and at the last one,
    its mean Jaccard index, its near-tie mass at each precision averaged over the steps, and its fallback positions
    of all its token positions."""
    _, mismatch = rollout_series(lines, "mismatch")
    _, jaccard = rollout_series(lines, "jaccard")
    near = {name: rollout_series(lines, f"near_tie.{name}")[1] for name in NEAR_TIE_DTYPES}
    totals: dict[int, list[int]] = {}
    for line in lines:
        for row in line["layers"]:
            kept = totals.setdefault(int(row["layer"]), [0, 0])
            kept[0] += int(row.get("fallback") or 0)
            kept[1] += int(row.get("tokens") or 0)
    return [[f"layer {layer}", _mean(values), _last(values), _mean(jaccard[layer]),
             *[_mean(near[name][layer]) for name in NEAR_TIE_DTYPES], f"{totals[layer][0]} of {totals[layer][1]}"]
            for layer, values in mismatch.items()]


def first_mismatch_rows(lines: list[dict[str, Any]]) -> list[list[Any]]:
    """Over every recorded step, the token positions whose first differing layer is each routed layer, and those
    where every layer agrees: ``[label, positions, share of positions]``."""
    counts: dict[int, int] = {}
    none = tokens = 0
    for line in lines:
        first = line.get("first_mismatch") or {}
        for layer, n in (first.get("by_layer") or {}).items():
            counts[int(layer)] = counts.get(int(layer), 0) + int(n)
        none += int(first.get("none") or 0)
        tokens += int(first.get("tokens") or 0)

    def share(n: int) -> float | None:
        return round(n / tokens, 6) if tokens else None

    return [*([f"layer {layer}", n, share(n)] for layer, n in sorted(counts.items())),
            ["none (every layer agrees)", none, share(none)]]


def raised_steps(lines: list[dict[str, Any]]) -> list[int]:
    """The recorded steps at which a rollout alert was raised (a WARN: a bound crossed, a sustained rise)."""
    return [int(line["step"]) for line in lines if any(a.get("level") == "WARN" for a in line.get("alerts") or [])]


def fig_rollout(lines: list[dict[str, Any]]):
    """Mismatch per routed layer over the recorded steps (top; the share of positions routed differently in some
    layer, ``token_mismatch``, in black) and each layer's bf16 near-tie mass (bottom); a step that raised a rollout
    alert is shaded red. Artists carry a ``gid`` (``layer N``, ``token mismatch``, ``near tie layer N``,
    ``alarm S``)."""
    from atlas_tracking.viz.figures import pyplot

    plt = pyplot()
    steps, mismatch = rollout_series(lines, "mismatch")
    _, near = rollout_series(lines, "near_tie.bf16")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.9, max(len(mismatch), 1)))
    labelled = len(mismatch) <= 12
    for color, (layer, values) in zip(colors, mismatch.items()):
        top.plot(steps, values, "o-", lw=0.9, ms=2.5, color=color, gid=f"layer {layer}",
                 label=f"layer {layer}" if labelled else None)
        bottom.plot(steps, near[layer], "o-", lw=0.9, ms=2.5, color=color, gid=f"near tie layer {layer}")
    top.plot(steps, [summarize(line).get("token_mismatch", np.nan) for line in lines], "s--", color="black", lw=1.2,
             ms=3, gid="token mismatch", label="token mismatch (any layer)")
    for step in raised_steps(lines):
        for ax in (top, bottom):
            ax.axvspan(step - 0.5, step + 0.5, color="#e74c3c", alpha=0.25, lw=0, gid=f"alarm {step}")
    top.set_ylabel("mismatch", fontsize=8)
    top.set_title("Rollout agreement: routing mismatch per layer over steps (black: any layer)", fontsize=9)
    top.legend(loc="best", fontsize=6, ncol=3)
    bottom.set_ylabel("near-tie bf16", fontsize=8)
    bottom.set_xlabel("step")
    return fig
