"""The report's router-expert coupling section (docs/receipts.md#router-expert-coupling): a layers x experts picture of
each expert's alignment beside its load share, and the co-movement of the last gate per layer.

Example:
    >>> layers = [{"index": 0, "expert_load": [3, 1, 0], "alignment": [0.6, -0.2, None], "alignment_median": 0.2},
    ...           {"index": 1, "expert_load": [2, 2, 0]}]
    >>> labels, grid = alignment_grid(layers)
    >>> labels, grid.tolist()
    (['layer 0'], [[0.6, -0.2, nan]])
    >>> "alignment" in coupling_section({"step": 5, "layers": layers}, lambda png, alt: alt)[0]
    True
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

import numpy as np

from atlas_tracking.artifacts.expert_text import layer_label
from atlas_tracking.viz.figures import expert_grids, expert_panel, png_bytes, pyplot

NOTE = ("Alignment: the cosine between each expert's router row (in the receipts' state space) and the mean angular "
        "state of the canary tokens routed to it; negative: the row points away from the tokens it serves; blank: "
        "no token reached the expert. Co-movement: the cosine between the change of a router row since the baseline "
        "and the change of its expert's mean state (field); 'still' counts rows that did not move (a frozen "
        "router). Definitions and limits: docs/receipts.md#router-expert-coupling.")
"""What the report says above the coupling picture."""


def alignment_grid(layers: list[dict[str, Any]]) -> tuple[list[str], np.ndarray]:
    """Layers x experts grid of each expert's alignment (NaN: dead, or a layer with fewer experts), for the layers
    that carry one, labelled by :func:`~atlas_tracking.artifacts.expert_text.layer_label`."""
    rows = [lay for lay in layers if lay.get("alignment")]
    width = max((len(lay["alignment"]) for lay in rows), default=0)
    grid = np.full((len(rows), width), np.nan)
    for i, lay in enumerate(rows):
        grid[i, :len(lay["alignment"])] = [np.nan if a is None else a for a in lay["alignment"]]
    return [layer_label(lay) for lay in rows], grid


def fig_alignment(layers: list[dict[str, Any]], step: int):
    """Two layers x experts heatmaps of one gate: each expert's share of its layer's routes (left) and its alignment
    on a diverging scale in [-1, 1] (right), row for row."""
    plt = pyplot()
    with_alignment = [lay for lay in layers if lay.get("alignment")]
    load_labels, share, _ = expert_grids(with_alignment)
    labels, grid = alignment_grid(with_alignment)
    fig, axes = plt.subplots(1, 2, squeeze=False, layout="constrained",
                             figsize=(2 * min(9.0, 3.5 + 0.08 * grid.shape[1]), max(2.5, 0.3 * len(labels) + 1.4)))
    panels = [(share, load_labels, "share of the layer's routes", "viridis", 0.0, None),
              (grid, labels, "alignment of the router row with its tokens", "RdBu", -1.0, 1.0)]
    for ax, (values, names, title, cmap, vmin, vmax) in zip(axes[0], panels):
        expert_panel(fig, ax, values, names, title, cmap, vmin, vmax)
    fig.suptitle(f"Expert load and router-row alignment at step {step} (layers x experts)", fontsize=10)
    return fig


def _cell(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else html.escape(str(x))


def coupling_table(layers: list[dict[str, Any]]) -> str:
    """Per layer: alignment median, lower decile, negative share, dead experts; co-movement (state, field, share
    against) and the rows that did not move."""
    keys = ("alignment_median", "alignment_p10", "alignment_negative", "comove_state", "comove_state_against",
            "comove_field", "comove_router_still")
    head = "".join(f"<th>{h}</th>" for h in ("layer", "align median", "align p10", "align < 0", "dead",
                                              "co-move state", "against", "co-move field", "rows still"))
    body = "".join(
        f"<tr><td>{html.escape(layer_label(lay))}</td>"
        + "".join(f"<td>{_cell(lay.get(k))}</td>" for k in keys[:3])
        + f"<td>{len(lay.get('alignment_dead') or [])}</td>"
        + "".join(f"<td>{_cell(lay.get(k))}</td>" for k in keys[3:]) + "</tr>"
        for lay in layers)
    return f"<table><tr>{head}</tr>{body}</table>"


def coupling_section(last: dict[str, Any], img: Callable[[bytes, str], str]) -> tuple[str, dict[str, bytes]]:
    """The report's HTML section for the last gate and its figure (none when no layer has an alignment); ``img``
    (png, alt text) is the page's image markup."""
    layers = last.get("layers", [])
    if not any(lay.get("alignment") for lay in layers):
        reasons = {lay.get("alignment_absent") for lay in layers if lay.get("alignment_absent")}
        why = "; ".join(sorted(reasons)) or "this gate was measured before alignment existed"
        return f"<h2>Router-expert coupling</h2><p>No alignment: {html.escape(why)}</p>", {}
    figures = {"alignment.png": png_bytes(fig_alignment(layers, last["step"]))}
    text = (f"<h2>Router-expert coupling (last gate)</h2><p>{html.escape(NOTE)}</p>"
            f"{img(figures['alignment.png'], 'expert load and router-row alignment: layers x experts')}"
            f"{coupling_table(layers)}")
    return text, figures
