"""Matplotlib figures of gates and layers, shared by the HTML report and the tracker sinks (Agg backend)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from atlas_tracking.artifacts.expert_text import layer_label
from atlas_tracking.artifacts.load_summary import summarize
from atlas_tracking.artifacts.record import finite_number
from atlas_tracking.receipts.experts import expert_shares, share_change
from atlas_tracking.receipts.load import layer_stats
from atlas_tracking.schema.record import STAGE_CODES, Status
from atlas_tracking.viz.tables import NA_TOP1, top1
from atlas_tracking.viz.train_load import is_early, raised

STATUS_COLORS = {Status.BASELINE: "#7f8c8d", Status.GREEN: "#2e8b57", Status.YELLOW: "#d4a017", Status.RED: "#c0392b"}
STAGE_ORDER = sorted(STAGE_CODES, key=STAGE_CODES.__getitem__)
TRAIN_LOAD = "Training-batch expert load"
"""What the layers x experts picture of an interval between gates shows (its title)."""


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
    ax2.set_ylabel("C2")
    ax2.set_xlabel("step")
    if all(r.get("c2") is None for r in recs) and any(top1(r) for r in recs):
        ax2.text(0.5, 0.5, f"C2: {NA_TOP1} (no co-active pairs)", ha="center", va="center", transform=ax2.transAxes)
        return fig
    ax2.plot(steps, [r.get("c2") for r in recs], "o-", color="#e67e22", label="C2 (mean over layers)")
    for b in (r for r in recs if r.get("status") == Status.BASELINE and r.get("c2") is not None):
        ax2.axhline(b["c2"], color="#7f8c8d", ls="--", lw=0.8)
    ax2.legend(loc="best", fontsize=8)
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


def fig_layer_c2(layers: list[dict[str, Any]], title: str, key: str = "c2"):
    """Per-layer bars of ``key`` (C2, or ``c2_delta``: its change since the baseline), coloured by layer group."""
    plt = pyplot()
    groups = layer_groups(layers)
    fig, ax = plt.subplots(figsize=(7, max(2.5, 0.28 * len(layers) + 1)))
    values = [lay.get(key) or 0.0 for lay in layers]
    palette = {"early": "#5dade2", "protected": "#e67e22", "late": "#8e44ad", "unprotected": "#95a5a6"}
    ax.barh([f"{g}: {layer_label(lay)}" for g, lay in zip(groups, layers)], values,
            color=[palette[g] for g in groups])
    ax.axvline(0, color="black", lw=0.6)
    ax.invert_yaxis()
    ax.set_xlabel({"c2": "C2", "c2_delta": "C2 now minus at the baseline"}.get(key, key))
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


def c2_change_row(record: dict[str, Any]) -> list[float | None]:
    """A gate's per-layer C2 change since its baseline (``c2_delta``), the heatmap's column: 0 at a baseline gate
    (its own reference), None where the gate recorded no change.

    >>> c2_change_row({"status": "BASELINE", "layers": [{"c2": 0.2}]}), c2_change_row({"layers": [{"c2_delta": -0.1}]})
    ([0.0], [-0.1])
    """
    base = record.get("status") == Status.BASELINE
    return [0.0 if base and lay.get("c2") is not None else lay.get("c2_delta") for lay in record.get("layers", [])]


def fig_c2_heatmap(history: list[tuple[int, list[float | None]]], layer_names: list[str]):
    """Layers x gates heatmap of each layer's C2 change since the baseline (rows: layers, columns: gate steps),
    on a diverging scale symmetric about zero: red is a fall (less compatible), blue a rise, white no change."""
    plt = pyplot()
    width = max(len(v) for _, v in history)
    grid = np.array([[np.nan if x is None else x for x in v] + [np.nan] * (width - len(v)) for _, v in history]).T
    bound = max(float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 0.0, 1e-9)
    fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(history) + 2), max(2.5, 0.3 * width + 1)))
    im = ax.imshow(grid, aspect="auto", cmap="RdBu", vmin=-bound, vmax=bound, interpolation="nearest")
    ax.set_xticks(range(len(history)), [str(s) for s, _ in history], fontsize=7)
    ax.set_yticks(range(width), layer_names[:width], fontsize=7)
    ax.set_xlabel("gate step")
    ax.set_title("C2 change since the baseline (layers x gates; 0 = no change)", fontsize=9)
    fig.colorbar(im, ax=ax, label="C2 now minus at the baseline")
    return fig


def expert_grids(layers: list[dict[str, Any]]) -> tuple[list[str], np.ndarray, np.ndarray | None]:
    """Layers x experts grids of each expert's share of its layer's routes and of the change of that share since
    the baseline (None when no layer has a baseline load), from the record's ``expert_load`` (NaN pads layers
    with fewer experts). Rows are the layers that carry loads, labelled by :func:`layer_label`.

    >>> labels, share, delta = expert_grids([{"index": 3, "expert_load": [1, 3], "expert_load_baseline": [2, 2]}])
    >>> labels, share.tolist(), delta.tolist()
    (['layer 3'], [[0.25, 0.75]], [[-0.25, 0.25]])
    """
    rows = [lay for lay in layers if lay.get("expert_load")]
    width = max((len(lay["expert_load"]) for lay in rows), default=0)
    share = np.full((len(rows), width), np.nan)
    delta = np.full((len(rows), width), np.nan)
    for i, lay in enumerate(rows):
        n = len(lay["expert_load"])
        share[i, :n] = expert_shares(lay["expert_load"])
        if lay.get("expert_load_baseline"):
            delta[i, :n] = share_change(lay["expert_load"], lay["expert_load_baseline"])
    has_delta = any(lay.get("expert_load_baseline") for lay in rows)
    return [layer_label(lay) for lay in rows], share, delta if has_delta else None


def fig_expert_load(layers: list[dict[str, Any]], step: int, what: str = "Expert load"):
    """Layers x experts heatmaps of one gate (or interval): each expert's share of its layer's routes (left) and,
    against a baseline, the change of that share since it (right)."""
    plt = pyplot()
    labels, share, delta = expert_grids(layers)
    panels = [(share, "share of the layer's routes", "viridis", 0.0, None)]
    if delta is not None:
        bound = max(float(np.nanmax(np.abs(delta))) if np.isfinite(delta).any() else 0.0, 1e-9)
        panels.append((delta, "change since the baseline", "RdBu_r", -bound, bound))
    n_experts = share.shape[1]
    fig, axes = plt.subplots(1, len(panels), squeeze=False, layout="constrained",
                             figsize=(min(9.0, 3.5 + 0.08 * n_experts) * len(panels), max(2.5, 0.3 * len(labels) + 1.4)))
    for ax, (grid, title, cmap, vmin, vmax) in zip(axes[0], panels):
        expert_panel(fig, ax, grid, labels, title, cmap, vmin, vmax)
    fig.suptitle(f"{what} at step {step} (layers x experts)", fontsize=10)
    return fig


def expert_panel(fig: Any, ax: Any, grid: np.ndarray, labels: list[str], title: str, cmap: str, vmin: float,
                 vmax: float | None) -> None:
    """One layers x experts heatmap on ``ax``: a row per layer (``labels``), experts ticked about 16 times across,
    its colour bar beside it."""
    im = ax.imshow(grid, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ticks = list(range(0, grid.shape[1], max(1, grid.shape[1] // 16)))
    ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=7)
    ax.set_xlabel("expert")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax)


def fig_expert_change(layers: list[dict[str, Any]], step: int):
    """One layers x experts picture of a gate for the report's first screen: the change of each expert's share
    since the baseline on a diverging scale (red: fewer routes, blue: more; each layer's share without a baseline),
    dead experts marked x."""
    plt = pyplot()
    labels, share, delta = expert_grids(layers)
    grid, title = (share, "share of the layer's routes") if delta is None else (delta, "share change since the baseline")
    bound = max(float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 0.0, 1e-9)
    fig, ax = plt.subplots(figsize=(5.4, max(1.9, 0.28 * len(labels) + 1.2)), layout="constrained")
    im = ax.imshow(grid, aspect="auto", cmap="RdBu" if delta is not None else "viridis",
                   vmin=-bound if delta is not None else 0.0, vmax=bound, interpolation="nearest")
    rows, cols = np.nonzero(share == 0)
    ax.scatter(cols, rows, marker="x", s=14, color="black", lw=0.8, gid="dead", label="dead expert")
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ticks = list(range(0, share.shape[1], max(1, share.shape[1] // 16)))
    ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=7)
    ax.set_xlabel("expert", fontsize=8)
    ax.set_title(f"Expert load at step {step}: {title} (x: dead)", fontsize=8)
    fig.colorbar(im, ax=ax).ax.tick_params(labelsize=7)
    return fig


def fig_occupancy(recs: list[dict[str, Any]]):
    """The three occupancy axes per layer over gates: dead experts, load CV x 100 and router entropy, one thin
    line per routed layer and the summary the policy reads in black (mean dead, mean CV, min entropy)."""
    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    steps = [r["step"] for r in recs]
    n_layers = max((len(r.get("layers", [])) for r in recs), default=0)
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.9, max(n_layers, 1)))
    axes_spec = ((axes[0], "dead_experts", 1.0, "dead_experts", "dead experts", "mean dead experts"),
                 (axes[1], "load_cv", 100.0, "mean_cv", "load CV x100", "mean load CV x100"),
                 (axes[2], "router_entropy", 1.0, "min_entropy", "router entropy (nats)", "min entropy"))
    for ax, key, scale, summary, ylabel, summary_label in axes_spec:
        for i in range(n_layers):
            pts = [(r["step"], scale * r["layers"][i][key]) for r in recs
                   if i < len(r.get("layers", [])) and finite_number(r["layers"][i].get(key)) is not None]
            if pts:
                label = layer_label(next(r["layers"][i] for r in recs if i < len(r.get("layers", []))))
                ax.plot(*zip(*pts), "o-", lw=0.8, ms=3, color=colors[i], label=label if n_layers <= 12 else None)
        values = [finite_number(r.get(summary)) for r in recs]
        ax.plot(steps, [np.nan if v is None else v for v in values], "s--", color="black", lw=1.4, ms=4,
                label=summary_label)
        ax.set_ylabel(ylabel, fontsize=8)
    axes[0].set_ylim(bottom=-0.05 * max(1.0, axes[0].get_ylim()[1]), top=max(1.0, axes[0].get_ylim()[1]))
    axes[0].set_title("Occupancy per layer over gates (black: the summary the policy reads)")
    axes[0].legend(loc="best", fontsize=6, ncol=3)
    axes[2].set_xlabel("step")
    return fig


TRAIN_LOAD_AXES = (("cv", "load CV", "load_cv_max", "worst layer (max CV)"),
                   ("max_over_mean", "max / mean load", "max_over_mean", "max over layers"),
                   ("entropy", "normalised entropy", "entropy_min", "min over layers"))
"""The panels of :func:`fig_train_load`: the per-layer statistic, its axis label, the summary field drawn in black
(:class:`~atlas_tracking.schema.load.LoadSummary`) and its legend label."""


def load_series(lines: list[dict[str, Any]]) -> tuple[list[int], dict[int, dict[str, list[float]]]]:
    """The intervals' end steps and, per routed layer (the model's layer number), its load CV, busiest load over
    the mean and normalised entropy at each interval (NaN where the layer is absent or saw no route).

    >>> steps, series = load_series([{"step": 2, "layers": [{"layer": 3, "load": [3, 1]}]},
    ...                              {"step": 4, "layers": [{"layer": 3, "load": [0, 0]}]}])
    >>> steps, series[3]["cv"][0], series[3]["max_over_mean"], bool(np.isnan(series[3]["entropy"][1]))
    ([2, 4], 0.5, [1.5, nan], True)
    """
    steps = [int(line["step"]) for line in lines]
    series: dict[int, dict[str, list[float]]] = {}
    for i, line in enumerate(lines):
        for row in line["layers"]:
            values = series.setdefault(int(row["layer"]), {key: [np.nan] * len(lines) for key, *_ in TRAIN_LOAD_AXES})
            if sum(row["load"]) > 0:
                stats = layer_stats(row["load"])
                for key, *_ in TRAIN_LOAD_AXES:
                    values[key][i] = float(getattr(stats, key))
    return steps, dict(sorted(series.items()))


def _once(seen: set[str] | None, what: str) -> str | None:
    """``what`` as a legend label the first time it is seen (never when ``seen`` is None)."""
    if seen is None or what in seen:
        return None
    seen.add(what)
    return what


def fig_train_load(lines: list[dict[str, Any]], gates: list[dict[str, Any]]):
    """The training-batch load between gates (``load.jsonl``): per routed layer over the intervals (x: the
    interval's last step) its load CV, busiest load over the mean and normalised entropy, one thin line per layer
    and the bounded summary in black; the gates as dotted grey lines, early gates (``trigger`` telemetry) as solid
    red ones; the interval that raised the alarm shaded red, those while it stands lightly. Artists carry a ``gid``
    (``layer N``, ``summary``, ``gate S``, ``early gate S``, ``alarm S``, ``alarm standing S``)."""
    plt = pyplot()
    steps, series = load_series(lines)
    fig, axes = plt.subplots(len(TRAIN_LOAD_AXES), 1, figsize=(7, 6.5), sharex=True)
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.9, max(len(series), 1)))
    summaries = [summarize(line) for line in lines]
    for row, (ax, (key, ylabel, summary_key, summary_label)) in enumerate(zip(axes, TRAIN_LOAD_AXES)):
        seen: set[str] | None = None if row else set()  # the top panel's legend names each kind of mark once
        for color, (layer, values) in zip(colors, series.items()):
            ax.plot(steps, values[key], "o-", lw=0.8, ms=2.5, color=color, gid=f"layer {layer}",
                    label=_once(seen, f"layer {layer}") if len(series) <= 12 else None)
        ax.plot(steps, [s.get(summary_key, np.nan) for s in summaries], "s--", color="black", lw=1.3, ms=3,
                gid="summary", label=summary_label)
        for gate in gates:
            early = is_early(gate)
            ax.axvline(gate["step"], color="#c0392b" if early else "#7f8c8d", ls="-" if early else ":",
                       lw=1.4 if early else 0.9, gid=f"{'early gate' if early else 'gate'} {gate['step']}",
                       label=_once(seen, "early gate" if early else "gate"))
        for line in lines:
            if raised(line) or line.get("alarm"):
                what = "alarm" if raised(line) else "alarm standing"
                ax.axvspan(line.get("first_step", line["step"]) - 0.5, line["step"] + 0.5, color="#e74c3c",
                           alpha=0.25 if raised(line) else 0.08, lw=0, gid=f"{what} {line['step']}",
                           label=_once(seen, what))
        ax.set_ylabel(ylabel, fontsize=8)
        ax.legend(loc="best", fontsize=6, ncol=3)
    axes[0].set_title("Training-batch load per layer between gates (black: the bounded summary)", fontsize=9)
    axes[-1].set_xlabel("step (end of the interval)")
    return fig
