"""Parameter drift per module group: the secondary surface, read beside the atlas drift.

For a group G of parameters (router, experts, attention, norms, embeddings, other) and the reference
parameters theta_ref kept when the atlas baseline was taken, a gate reports

- ``relative_distance = ||theta_G - theta_ref,G||_2 / ||theta_ref,G||_2`` (L2 over every element of every
  parameter of the group; 0 when nothing moved, None when the reference norm is 0 and something moved),
- ``moved``: how many elements differ from the reference exactly (``theta != theta_ref``, NaN counts as moved),
- ``count``: how many elements the group holds,

and the same over the whole model (``total``). Each parameter tensor contributes four sums
(:data:`SUM_FIELDS`); sums add over tensors and over the shards of a sharded tensor, so a group's figures
are one addition of its tensors' (or its shards') sums. The squared sums are accumulated in float64.

Example:
    >>> import torch
    >>> now, ref = torch.tensor([3.0, 4.0, 1.0]), torch.tensor([3.0, 4.0, 0.0])
    >>> tensor_sums(now, ref).tolist()
    [1.0, 25.0, 1.0, 3.0]
    >>> s = summarize({"experts": tensor_sums(ref, ref), "router": tensor_sums(now, ref)})
    >>> s["groups"]["experts"], s["groups"]["router"]["relative_distance"], s["total"]["moved"]
    ({'relative_distance': 0.0, 'moved': 0, 'count': 3}, 0.2, 1)
    >>> drift_line(s)
    'param drift: 1 of 6 parameters moved (total 0.1414); router 1/3 0.2; experts 0/3 0'
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

GROUPS = ("router", "experts", "attention", "norms", "embeddings", "other")
"""Module groups, in report order: every parameter belongs to exactly one (``other``: dense MLPs, shared
experts, anything the rules do not name)."""

SUM_FIELDS = ("diff_sq", "ref_sq", "moved", "count")
"""The additive sums of one tensor: sum (now - ref)^2, sum ref^2, elements with now != ref, elements."""

CHUNK = 1 << 22
"""Elements per float64 chunk (32 MiB), so a large fused expert tensor never doubles in memory at once."""


def tensor_sums(now: torch.Tensor, ref: torch.Tensor, chunk: int = CHUNK) -> np.ndarray:
    """The four :data:`SUM_FIELDS` of one tensor (or shard) against its reference, as float64.

    ``now`` and ``ref`` must have the same number of elements; ``ref`` may live on another device (it is
    moved to ``now``'s chunk by chunk).

    >>> tensor_sums(torch.ones(5), torch.zeros(5), chunk=2).tolist()
    [5.0, 0.0, 5.0, 5.0]
    """
    a, b = now.detach().reshape(-1), ref.detach().reshape(-1)
    if a.numel() != b.numel():
        raise ValueError(f"a tensor of {a.numel()} elements cannot be compared with a reference of {b.numel()}")
    diff_sq = ref_sq = 0.0
    moved = 0
    for start in range(0, a.numel(), chunk):
        x = a[start:start + chunk]
        y = b[start:start + chunk].to(x.device, non_blocking=True)
        moved += int((x != y).sum())
        x64, y64 = x.double(), y.double()
        diff_sq += float((x64 - y64).square().sum())
        ref_sq += float(y64.square().sum())
    return np.array([diff_sq, ref_sq, moved, a.numel()], dtype=np.float64)


def relative_distance(diff_sq: float, ref_sq: float) -> float | None:
    """``sqrt(diff_sq / ref_sq)``; 0 when nothing moved, None when only the reference norm is 0.

    >>> relative_distance(1.0, 4.0), relative_distance(0.0, 0.0), relative_distance(1.0, 0.0)
    (0.5, 0.0, None)
    """
    if diff_sq == 0.0:
        return 0.0
    if ref_sq == 0.0:
        return None
    return math.sqrt(diff_sq / ref_sq)


def _entry(sums: Sequence[float]) -> dict[str, float | int | None]:
    diff_sq, ref_sq, moved, count = (float(v) for v in sums)
    return {"relative_distance": relative_distance(diff_sq, ref_sq), "moved": int(moved), "count": int(count)}


def summarize(sums: Mapping[str, Sequence[float]]) -> dict[str, dict]:
    """Per-group and total figures from per-group :data:`SUM_FIELDS` (groups with no parameter are left out)."""
    groups = {g: _entry(sums[g]) for g in GROUPS if g in sums and float(sums[g][3]) > 0}
    unknown = set(sums) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown parameter groups {sorted(unknown)}; the groups are {', '.join(GROUPS)}")
    total = np.sum([np.asarray(sums[g], dtype=np.float64) for g in sums], axis=0) if sums else np.zeros(4)
    return {"groups": groups, "total": _entry(total)}


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _dist(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def drift_line(summary: Mapping[str, dict]) -> str:
    """One line for the console and the report: moved / total per group and the relative distances; a group
    with nothing moved says so (``experts 0/3 0`` reads "experts frozen").

    >>> drift_line({"groups": {"experts": {"relative_distance": 0.0, "moved": 0, "count": 691_000_000_000}},
    ...             "total": {"relative_distance": 0.001, "moved": 12_000_000_000, "count": 691_000_000_000}})
    'param drift: 12B of 691B parameters moved (total 0.001); experts 0/691B 0'
    """
    t = summary["total"]
    parts = [f"{g} {_count(e['moved'])}/{_count(e['count'])} {_dist(e['relative_distance'])}"
             for g, e in summary["groups"].items()]
    return (f"param drift: {_count(t['moved'])} of {_count(t['count'])} parameters moved "
            f"(total {_dist(t['relative_distance'])}); " + "; ".join(parts))
