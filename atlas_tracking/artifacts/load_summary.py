"""What a ``load.jsonl`` line says in a few numbers: the bounded summary trackers receive at every interval, and the
layers x experts grid of the pictures and tables they receive every ``telemetry.picture_every`` intervals.

The summary has a fixed set of keys whatever the model's depth and width (:class:`~atlas_tracking.schema.load.
LoadSummary`), plus the worst layer's ``telemetry.top_experts`` busiest and idlest experts; nothing per layer or
per expert beyond that.

Example:
    >>> line = {"step": 50, "tokens": 100, "layers": [
    ...     {"layer": 1, "name": "l1", "load": [50, 50, 50, 50], "dropped": None, "tokens": 100},
    ...     {"layer": 3, "name": "l3", "load": [140, 40, 20, 0], "dropped": 10, "tokens": 100}]}
    >>> s = summarize(line)
    >>> s["worst_layer"], s["max_over_mean"], s["dead_fraction_max"], s["dropped_fraction"]
    (3, 2.8, 0.25, 0.05)
    >>> m = load_metrics(line, top=1)
    >>> m["atlas/train/top1_expert"], m["atlas/train/top1_share"], m["atlas/train/bottom1_expert"]
    (0.0, 0.7, 3.0)
"""

from __future__ import annotations

from typing import Any

from atlas_tracking.receipts.load import layer_stats, max_over_mean, ranked_experts
from atlas_tracking.schema.load import SUMMARY_KEYS, LoadSummary


def summarize(line: dict[str, Any]) -> LoadSummary:
    """The bounded summary of one interval (layers that saw no token are left out), with what the alarm made of it
    (the line's ``breach`` and ``alarm``)."""
    breach, alarm = len(line.get("breach") or []), bool(line.get("alarm"))
    rows = [row for row in line["layers"] if sum(row["load"]) > 0]
    if not rows:
        return LoadSummary(tokens=int(line.get("tokens", 0)), breach_layers=breach, alarm=int(alarm))
    stats = [layer_stats(row["load"]) for row in rows]
    worst = max(range(len(rows)), key=lambda i: (stats[i].cv, -i))
    out = LoadSummary(
        tokens=int(line.get("tokens", 0)), load_cv_max=stats[worst].cv, worst_layer=int(rows[worst]["layer"]),
        max_over_mean=max(s.max_over_mean for s in stats), dead_fraction_max=max(s.dead_fraction for s in stats),
        entropy_min=min(s.entropy for s in stats), breach_layers=breach, alarm=int(alarm))
    ep = [max_over_mean(row["ep_tokens"]) for row in rows if row.get("ep_tokens")]
    if ep:
        out["overload_factor"] = max(ep)
    dropping = [row for row in rows if row.get("dropped") is not None]
    if dropping:
        out["dropped_fraction"] = sum(row["dropped"] for row in dropping) / sum(sum(row["load"]) for row in dropping)
    return out


def worst_row(line: dict[str, Any]) -> dict[str, Any] | None:
    """The layer of the line with the largest load CV (the summary's ``worst_layer``), or None."""
    rows = [row for row in line["layers"] if sum(row["load"]) > 0]
    return max(rows, key=lambda row: layer_stats(row["load"]).cv, default=None)


def load_metrics(line: dict[str, Any], top: int = 3) -> dict[str, float]:
    """The tracker metrics of one interval: :func:`summarize` under its ``atlas/train/...`` keys, and the worst
    layer's ``top`` busiest and idlest experts (``atlas/train/top1_expert``, ``atlas/train/top1_share``, ...)."""
    summary = summarize(line)
    metrics = {SUMMARY_KEYS[k]: float(v) for k, v in summary.items() if v is not None}
    worst = worst_row(line)
    if worst is not None and top > 0:
        busiest, idlest = ranked_experts(worst["load"], top)
        for end, ranked in (("top", busiest), ("bottom", idlest)):
            for i, (expert, share) in enumerate(ranked, start=1):
                metrics[f"atlas/train/{end}{i}_expert"] = float(expert)
                metrics[f"atlas/train/{end}{i}_share"] = share
    return metrics


def expert_layers(line: dict[str, Any], reference: dict[str, list[int]] | None = None) -> list[dict[str, Any]]:
    """The line's layers in the shape the layers x experts figure and table read (``index``, ``name``,
    ``expert_load`` and, against a reference interval, ``expert_load_baseline``)."""
    out = []
    for row in line["layers"]:
        entry = {"index": row["layer"], "name": row["name"], "expert_load": row["load"]}
        if reference and len(reference.get(row["name"], [])) == len(row["load"]):
            entry["expert_load_baseline"] = reference[row["name"]]
        out.append(entry)
    return out
