"""Matplotlib figures of gates and layers, shared by the HTML report and the tracker sinks (Agg backend)."""

from __future__ import annotations

import io
from typing import Any

from atlas_tracking.schema.record import STAGE_CODES, Status

STATUS_COLORS = {Status.BASELINE: "#7f8c8d", Status.GREEN: "#2e8b57", Status.YELLOW: "#d4a017", Status.RED: "#c0392b"}
STAGE_ORDER = sorted(STAGE_CODES, key=STAGE_CODES.__getitem__)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig, dpi: int = 110) -> bytes:
    """Render a figure to PNG bytes and close it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    pyplot().close(fig)
    return buf.getvalue()


def fig_loss_c2(recs: list[dict[str, Any]]):
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    pts = [(r["step"], r["loss"]) for r in recs if r.get("loss") is not None]
    if pts:
        ax1.plot(*zip(*pts), "o-", color="#34495e")
    ax1.set_ylabel("loss")
    ax1.set_title("Objective (top) and co-active overlap compatibility C2 (bottom)")
    steps = [r["step"] for r in recs]
    ax2.plot(steps, [r.get("c2") for r in recs], "o-", color="#e67e22", label="C2 (mean over layers)")
    base = [r for r in recs if r.get("status") == Status.BASELINE]
    for b in base:
        ax2.axhline(b.get("c2"), color="#7f8c8d", ls="--", lw=0.8)
    ax2.set_ylabel("C2")
    ax2.set_xlabel("step")
    ax2.legend(loc="best", fontsize=8)
    return fig


def fig_dead(recs: list[dict[str, Any]]):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 2.8))
    steps = [str(r["step"]) for r in recs]
    colors = [STATUS_COLORS.get(r.get("status"), "#95a5a6") for r in recs]
    ax.bar(steps, [r.get("dead_experts") or 0 for r in recs], color=colors)
    ax.set_ylabel("dead experts / layer")
    ax.set_xlabel("gate step (colour = status)")
    ax.set_title("Dead experts per gate")
    return fig


def layer_groups(layers: list[dict[str, Any]]) -> list[str]:
    """Each routed layer's group from the record's own ``protected`` flag (``lifecycle.protected_layers``):
    'protected', 'early' before the first protected layer, 'late' after the last, 'unprotected' between.

    >>> layer_groups([{"protected": p} for p in (False, False, True, True, True, True, False, False)])
    ['early', 'early', 'protected', 'protected', 'protected', 'protected', 'late', 'late']
    """
    flags = [bool(lay.get("protected")) for lay in layers]
    if not any(flags):
        return ["unprotected"] * len(layers)
    first, last = flags.index(True), len(flags) - 1 - flags[::-1].index(True)
    return ["protected" if f else "early" if i < first else "late" if i > last else "unprotected"
            for i, f in enumerate(flags)]


def fig_layer_c2(layers: list[dict[str, Any]], title: str):
    plt = pyplot()
    groups = layer_groups(layers)
    fig, ax = plt.subplots(figsize=(7, max(2.5, 0.28 * len(layers) + 1)))
    values = [lay.get("c2") or 0.0 for lay in layers]
    palette = {"early": "#5dade2", "protected": "#e67e22", "late": "#8e44ad", "unprotected": "#95a5a6"}
    ax.barh([f"{g}: {lay.get('name')}" for g, lay in zip(groups, layers)], values,
            color=[palette[g] for g in groups])
    ax.axvline(0, color="black", lw=0.6)
    ax.invert_yaxis()
    ax.set_xlabel("C2")
    ax.set_title(title)
    return fig


def fig_timeline(recs: list[dict[str, Any]]):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 2.8))
    steps = [r["step"] for r in recs]
    seen = {r.get("stage") for r in recs}
    # Pretraining stages (codes 7-9) and the post-training escalation get rows only when the run has them.
    rows = [s for s in STAGE_ORDER if s in seen or s == "baseline"
            or (STAGE_CODES[s] < 7 and seen & set(STAGE_ORDER[1:7])) or (STAGE_CODES[s] >= 7 and seen & set(STAGE_ORDER[7:]))]
    levels = [rows.index(r["stage"]) if r.get("stage") in rows else 0 for r in recs]
    ax.step(steps, levels, where="post", color="#95a5a6")
    ax.scatter(steps, levels, c=[STATUS_COLORS.get(r.get("status"), "#95a5a6") for r in recs], zorder=3, s=40)
    for r, y in zip(recs, levels):
        alert_levels = [a["level"] for a in r.get("alerts", [])]
        if alert_levels:
            ax.annotate("+".join(alert_levels), (r["step"], y), textcoords="offset points", xytext=(0, 8),
                        ha="center", fontsize=7, color="#c0392b" if "ERROR" in alert_levels else "#7d6608")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows, fontsize=8)
    ax.set_xlabel("step")
    ax.set_title("Stage timeline (dots coloured by status; alert levels annotated)")
    return fig


def fig_c2_heatmap(history: list[tuple[int, list[float | None]]], layer_names: list[str]):
    """Layers x gates heatmap of C2 (rows: layers, columns: gate steps)."""
    import numpy as np

    plt = pyplot()
    width = max(len(v) for _, v in history)
    grid = np.array([[np.nan if x is None else x for x in v] + [np.nan] * (width - len(v)) for _, v in history]).T
    fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(history) + 2), max(2.5, 0.3 * width + 1)))
    im = ax.imshow(grid, aspect="auto", cmap="RdYlGn", interpolation="nearest")
    ax.set_xticks(range(len(history)), [str(s) for s, _ in history], fontsize=7)
    ax.set_yticks(range(width), layer_names[:width], fontsize=7)
    ax.set_xlabel("gate step")
    fig.colorbar(im, ax=ax, label="C2")
    return fig
