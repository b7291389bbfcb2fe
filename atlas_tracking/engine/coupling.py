"""Router-expert coupling at a gate (docs/receipts.md#router-expert-coupling): the capture's per-expert sums merged over
the processes, the layer's per-window entry for alignment, the vectors a baseline keeps, and co-movement against them.

Each process sums the angular states and tangent fields of the tokens of the windows it owns, routed to each expert
(``[E, d]`` each, ``engine/capture.py``); the gate's sums are their sums. A baseline keeps, per routed layer, the router
rows in state space and each expert's mean state and mean field (``{i}.router_rows0``, ``{i}.state_mean0``,
``{i}.field_mean0``, ``[E, d]`` float32 each); a gate against it stores per expert the inner products of their
changes (``per_window["layers"][i]["comove"]``), compared at the baseline's float32, so that what did not change
changes by exactly 0; co-movement is derived and verified from them.

Example:
    >>> import numpy as np
    >>> parts = [{"rows": np.ones((2, 3)), "state": np.ones((2, 3)), "field": np.zeros((2, 3))},
    ...          {"rows": np.ones((2, 3)), "state": np.ones((2, 3)), "field": np.ones((2, 3))}]
    >>> merged = merge(parts)
    >>> merged["state"][0].tolist(), merged["field"][1].tolist()
    ([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])
    >>> means = expert_means(merged, np.array([2, 0]), frozenset())
    >>> means["state"][0].tolist(), bool(np.isnan(means["state"][1]).all())
    ([1.0, 1.0, 1.0], True)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from atlas_tracking.receipts.coupling import comovement_sums, resultants

BASELINE_TENSORS = {"rows": "router_rows0", "state": "state_mean0", "field": "field_mean0"}
"""What a baseline keeps per routed layer for co-movement, under ``{i}.<name>``."""

Store = Callable[[torch.Tensor], torch.Tensor]
"""How a baseline keeps a ``[E, d]`` float32 tensor (``AnchorStorage.store_fields``)."""
NO_ROWS = ("the router holds no single [experts, width] weight to read its rows from "
           "(docs/receipts.md#router-expert-coupling)")
"""Why a layer has no alignment."""
OLD_BASELINE = "the baseline was saved without router rows and mean states (before co-movement was measured)"
"""Why a gate has no co-movement against an older baseline."""


def capture_sums(sums: dict[str, torch.Tensor] | None, n_experts: int, width: int) -> dict[str, np.ndarray] | None:
    """One process's coupling of one layer as numpy (None when the router has no rows to read), from its host
    tensors: its rows and the state and field sums of the windows it kept (zeros where it kept none)."""
    if sums is None:
        return None
    zeros = np.zeros((n_experts, width), np.float32)
    return {"rows": sums["rows"].numpy(), **{k: sums[k].numpy() if k in sums else zeros for k in ("state", "field")}}


def merge(parts: list[dict[str, np.ndarray] | None]) -> dict[str, np.ndarray] | None:
    """The gate's coupling sums of one layer: every process's state and field sums added, the rows of the first."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    out = {"rows": np.asarray(present[0]["rows"], np.float64)}
    for key in ("state", "field"):
        out[key] = np.sum([np.asarray(p[key], np.float64) for p in present], axis=0)
    return out


def window_entry(dot: np.ndarray, sums: dict[str, np.ndarray], loads: np.ndarray) -> dict[str, Any]:
    """A layer's per-window ``alignment`` entry of the artifact: the per-window dots ``[W, E]``, each expert's
    concentration and its row's length (docs/receipts.md#router-expert-coupling)."""
    res = resultants(sums["state"], np.asarray(loads).sum(axis=0))
    return {"dot": dot, "resultant": [None if not np.isfinite(r) else float(r) for r in res],
            "row_norm": np.linalg.norm(sums["rows"], axis=-1).tolist()}


def expert_means(sums: dict[str, np.ndarray], loads: np.ndarray, zero_experts: frozenset[int]) -> dict[str, np.ndarray]:
    """The rows, each expert's mean angular state and its mean tangent field over its routed tokens (``[E, d]``; NaN
    rows for a dead expert, and for a zero-computation expert's field)."""
    n = np.asarray(loads, np.float64).reshape(-1, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        state = np.where(n > 0, sums["state"] / np.where(n > 0, n, 1.0), np.nan)
        field = np.where(n > 0, sums["field"] / np.where(n > 0, n, 1.0), np.nan)
    field[sorted(zero_experts)] = np.nan
    return {"rows": sums["rows"], "state": state, "field": field}


def baseline_tensors(i: int, means: dict[str, np.ndarray], store: Store) -> dict[str, torch.Tensor]:
    """The tensors a baseline keeps for layer ``i``'s co-movement (:data:`BASELINE_TENSORS`), as ``store`` keeps
    them (the anchors' storage form: float32, half precision or projected)."""
    return {f"{i}.{name}": store(torch.from_numpy(np.asarray(means[key], np.float32)))
            for key, name in BASELINE_TENSORS.items()}


def baseline_means(tensors: Mapping[str, torch.Tensor], i: int) -> dict[str, np.ndarray] | None:
    """Layer ``i``'s rows and mean states and fields kept by a baseline (None: it kept none)."""
    names = {key: f"{i}.{name}" for key, name in BASELINE_TENSORS.items()}
    if any(name not in tensors for name in names.values()):
        return None
    return {key: tensors[name].double().numpy() for key, name in names.items()}


def comovement_entry(now: dict[str, np.ndarray] | None, base: dict[str, np.ndarray] | None, store: Store
                     ) -> dict[str, Any]:
    """A layer's per-window ``comove`` entry: the per-expert sums of :func:`comovement_sums`, or why it has none;
    ``now`` is stored as the baseline stored its vectors (``store``) before the changes are taken."""
    if now is None:
        return {"absent": NO_ROWS}
    if base is None:
        return {"absent": OLD_BASELINE}
    stored = {key: store(torch.from_numpy(np.asarray(now[key], np.float32))).double().numpy() for key in BASELINE_TENSORS}
    if base["rows"].shape != stored["rows"].shape:
        return {"absent": f"the baseline's router rows are {base['rows'].shape}, this gate's {stored['rows'].shape}"}
    return comovement_sums(stored, base)
