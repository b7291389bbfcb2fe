"""What a ``rollout.jsonl`` line says in a few numbers: the bounded summary trackers receive at every recorded step
(:class:`~atlas_tracking.schema.rollout.RolloutSummary`), the same keys whatever the model's depth.

Example:
    >>> line = {"step": 7, "tokens": 100, "alarm": True, "first_mismatch": {"tokens": 100, "none": 90}, "layers": [
    ...     {"layer": 1, "tokens": 100, "compared": 100, "fallback": 0, "mismatched": 4, "mismatch": 0.04,
    ...      "jaccard": 0.98, "near_tie": {"bf16": 0.05}},
    ...     {"layer": 3, "tokens": 100, "compared": 98, "fallback": 2, "mismatched": 9, "mismatch": 0.0918,
    ...      "jaccard": 0.95, "near_tie": {"bf16": 0.07}}]}
    >>> m = rollout_metrics(line)
    >>> m["atlas/rollout/worst_layer"], m["atlas/rollout/mismatch_mean"], m["atlas/rollout/token_mismatch"]
    (3.0, 0.065657, 0.1)
    >>> m["atlas/rollout/fallback_share"], m["atlas/rollout/alarm"], "atlas/rollout/k3" in m
    (0.01, 1.0, False)
"""

from __future__ import annotations

from typing import Any

from atlas_tracking.schema.rollout import SUMMARY_KEYS, RolloutSummary


def summarize(line: dict[str, Any]) -> RolloutSummary:
    """The bounded summary of one recorded step (layers that compared no position are left out of the worst
    layer, the mean and the minima)."""
    rows = [row for row in line["layers"] if row.get("compared")]
    tokens = sum(row["tokens"] for row in line["layers"])
    out = RolloutSummary(fallback_share=round(sum(row["fallback"] for row in line["layers"]) / tokens, 6)
                         if tokens else 0.0, alarm=int(bool(line.get("alarm"))))
    if rows:
        worst = max(rows, key=lambda row: (row["mismatch"], -row["layer"]))
        first = line["first_mismatch"]
        out.update(mismatch_max=worst["mismatch"], worst_layer=int(worst["layer"]),
                   mismatch_mean=round(sum(r["mismatched"] for r in rows) / sum(r["compared"] for r in rows), 6),
                   token_mismatch=round(1 - first["none"] / first["tokens"], 6) if first["tokens"] else 0.0,
                   jaccard_min=min(row["jaccard"] for row in rows),
                   near_tie_bf16_max=max((row["near_tie"]["bf16"] for row in rows
                                          if row["near_tie"].get("bf16") is not None), default=0.0))
    logprobs = line.get("logprobs") or {}
    if logprobs.get("tokens"):
        out.update(logprob_abs_diff=logprobs["abs_diff_mean"], k3=logprobs["k3"])
    return out


def rollout_metrics(line: dict[str, Any]) -> dict[str, float]:
    """The tracker scalars of one recorded step: ``atlas/rollout/<field>`` for every field the summary has."""
    return {SUMMARY_KEYS[name]: float(value) for name, value in summarize(line).items() if value is not None}
