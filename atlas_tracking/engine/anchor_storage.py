"""How a baseline stores its anchor tensors: the storage form chosen from a byte budget, and its error bounds.

Three forms (docs/receipts.md#compact-anchors), the most exact one that fits ``receipts.baseline_budget_bytes``:

- ``exact``: every tensor in float32, as measured;
- ``half``: ``z0`` and ``p0`` in float16 (``|z_i| <= sqrt(d)`` and ``p in [0, 1]`` cannot overflow it), ``u0`` in
  bfloat16 (expert outputs are unbounded: bfloat16 has float32's range), ``g0`` not stored but recomputed from
  ``z0`` and ``gamma0``;
- ``sketch``: as ``half``, with ``u0`` stored as ``S u0``, a fixed Gaussian projection ``S`` (``m x d``) generated
  from a seed kept in the manifest.

The rounded ``z0`` is what the baseline routes and evaluates, so a later gate transports the very state the
baseline saw, and the current fields are rounded (and projected) exactly as the base fields were.

>>> layout = [(7168, 8, 256)] * 58            # DeepSeek-V3: 58 routed layers, width 7168, k = 8, E = 256
>>> s = choose_storage(layout, 1024, budget=10**9, seed=0)
>>> s.form, s.sketch_dim, estimate_bytes(layout, 1024, s) <= 10**9
('sketch', 64, True)
>>> choose_storage([(64, 8, 128)] * 24, 1024, budget=10**9, seed=0).form
'exact'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from atlas_tracking.engine.coupling import BASELINE_TENSORS
from atlas_tracking.receipts.sketch import project, sketch_matrix
from atlas_tracking.schema.config import ConfigError, ReceiptsConfig

MIN_SKETCH_DIM = 16
"""The smallest projection dimension the budget may choose."""
BOUND_DELTA = 0.01
"""Failure probability (per layer) at which the manifest states the projection's bound."""
_UNIT_ROUNDOFF = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}
"""Relative rounding error of a stored value, against the float32 value measured (float32 itself: none)."""


@dataclass(frozen=True)
class AnchorStorage:
    """One storage form: the dtype of the base fields, whether the rest is half precision, the projection."""

    form: str
    """``exact``, ``half`` or ``sketch``."""
    fields_dtype: str = "float32"
    sketch_dim: int = 0
    sketch_seed: int = 0

    @property
    def compact(self) -> bool:
        """``z0`` and ``p0`` in float16 and ``g0`` recomputed (every form but ``exact``)."""
        return self.form != "exact"

    def round_state(self, z: torch.Tensor) -> torch.Tensor:
        """The canonical state as the baseline keeps it (float16 when compact), back in float32."""
        return z.to(torch.float16).float() if self.compact else z

    def store_fields(self, u: torch.Tensor) -> torch.Tensor:
        """Tangent fields ``[A, k, d]`` (or the coupling's per-expert vectors, ``[E, d]``) as stored: projected to
        ``[..., m]`` when sketched, in the fields dtype."""
        if self.sketch_dim:
            u = project(u, sketch_matrix(self.sketch_dim, u.shape[-1], self.sketch_seed).to(u.device))
        return u.to(getattr(torch, self.fields_dtype))

    @classmethod
    def of(cls, manifest: dict[str, Any] | None) -> AnchorStorage:
        """The form a baseline's manifest names (``anchors.storage``; none: exact float32)."""
        if not manifest:
            return cls("exact")
        return cls(manifest["form"], manifest["fields_dtype"], manifest["sketch_dim"], manifest["sketch_seed"])

    def describe(self, anchors: int, top_k: int) -> dict[str, Any]:
        """The manifest's ``anchors.storage`` (dtypes are added from the tensors by the baseline)."""
        return {"form": self.form, "fields_dtype": self.fields_dtype, "sketch_dim": self.sketch_dim,
                "sketch_seed": self.sketch_seed, "bounds": bounds(self, anchors, top_k)}


def per_anchor_bytes(width: int, top_k: int, n_experts: int, storage: AnchorStorage) -> int:
    """Bytes one anchor takes in one routed layer: z0, g0, R0 (int64), p0, u0 and b0 (one byte).

    >>> per_anchor_bytes(64, 8, 128, AnchorStorage("exact"))
    3137
    """
    field_bytes = 4 if storage.fields_dtype == "float32" else 2
    if not storage.compact:
        return 4 * 2 * width + 8 * top_k + 4 * n_experts + field_bytes * top_k * width + 1
    return 2 * width + 8 * top_k + 2 * n_experts + field_bytes * top_k * (storage.sketch_dim or width) + 1


def estimate_bytes(layout: list[tuple[int, int, int]], anchors: int, storage: AnchorStorage) -> int:
    """Bytes of a baseline's anchor tensors for routed layers ``(width, top_k, n_experts)``: gamma0 and the
    router-expert coupling's per-expert vectors included (stored as the fields are; a router without rows saves
    none of those)."""
    field_bytes = 4 if storage.fields_dtype == "float32" else 2
    return sum(anchors * per_anchor_bytes(d, k, e, storage) + 4 * d
               + len(BASELINE_TENSORS) * e * (storage.sketch_dim or d) * field_bytes for d, k, e in layout)


def candidates(fields_dtype: str | None, sketch_dim: int | None, min_width: int, seed: int) -> list[AnchorStorage]:
    """The forms a configuration allows, most exact first."""
    half = fields_dtype or "bfloat16"
    if fields_dtype == "float32":
        return [AnchorStorage("exact")]
    if sketch_dim:
        return [AnchorStorage("sketch", half, sketch_dim, seed)]
    forms = [AnchorStorage("half", half)] if fields_dtype else [AnchorStorage("exact"), AnchorStorage("half", half)]
    if sketch_dim is None:
        m = 1 << (min_width - 1).bit_length() - 1  # the largest power of two below the width
        while m >= MIN_SKETCH_DIM:
            forms.append(AnchorStorage("sketch", half, m, seed))
            m //= 2
    return forms


def choose_storage(layout: list[tuple[int, int, int]], anchors: int, budget: int | None, seed: int,
                   fields_dtype: str | None = None, sketch_dim: int | None = None) -> AnchorStorage:
    """The most exact allowed form whose anchor tensors fit ``budget`` bytes (None: the most exact one).

    A ConfigError names the budget, the estimate and what to change when none fits: nothing is reduced silently.

    >>> choose_storage([(7168, 8, 256)] * 58, 4096, budget=10**9, seed=0)
    Traceback (most recent call last):
    ...
    atlas_tracking.schema.config.ConfigError: 'receipts.baseline_budget_bytes' is 1000000000 but the most compact anchor storage (sketch, m = 16) of this model needs about 3606757376 bytes for 4096 anchors x 58 routed layers; lower 'receipts.anchors' or raise (or null) 'receipts.baseline_budget_bytes' (docs/receipts.md#compact-anchors)
    """
    if not layout:
        return AnchorStorage("exact")
    min_width = min(d for d, _, _ in layout)
    if sketch_dim and sketch_dim >= min_width:
        raise ConfigError(f"'receipts.anchor_sketch_dim' {sketch_dim} must be below the model's width {min_width}")
    forms = candidates(fields_dtype, sketch_dim, min_width, seed)
    if budget is None:
        return forms[0]
    for form in forms:
        if estimate_bytes(layout, anchors, form) <= budget:
            return form
    last = forms[-1]
    name = last.form + (f", m = {last.sketch_dim}" if last.sketch_dim else "")
    raise ConfigError(
        f"'receipts.baseline_budget_bytes' is {budget} but the most compact anchor storage ({name}) of this model "
        f"needs about {estimate_bytes(layout, anchors, last)} bytes for {anchors} anchors x {len(layout)} routed "
        "layers; lower 'receipts.anchors' or raise (or null) 'receipts.baseline_budget_bytes' "
        "(docs/receipts.md#compact-anchors)")


def norm_factors(m: int, events: int, delta: float) -> tuple[float, float]:
    """``(lo, hi)`` with ``lo <= ||S x|| / ||x|| <= hi`` for ``events`` fixed vectors at once, with probability
    at least ``1 - delta``: ``||S x||^2 / ||x||^2`` is chi-square(m) / m for a fixed ``x``, and the chi-square tails
    with ``t = ln(2 events / delta)`` give (docs/receipts.md#compact-anchors) ``1 - 2 sqrt(t/m) <= ||S x||^2 / ||x||^2 <= 1 + 2 sqrt(t/m) + 2 t/m``.

    >>> [round(f, 3) for f in norm_factors(128, 1, 0.01)]
    [0.77, 1.221]
    """
    t = math.log(2 * events / delta)
    return math.sqrt(max(0.0, 1 - 2 * math.sqrt(t / m))), math.sqrt(1 + 2 * math.sqrt(t / m) + 2 * t / m)


def content_interval(c: float, kappa: float | None, u: float) -> tuple[float, float]:
    """The interval a stored form's ``content_drift`` lies in when the exact one is ``c``: ``kappa`` the
    projection's norm-ratio spread ``hi / lo`` (1 without one; None: no bound, ``[0, 1]``), ``u`` the fields'
    unit roundoff.

    >>> content_interval(0.2, 1.0, 0.0), content_interval(0.2, None, 0.0)
    ((0.2, 0.2), (0.0, 1.0))
    """
    if kappa is None:
        return 0.0, 1.0
    return (max(0.0, (c / kappa - u) / (1 + u)), min(1.0, (c * kappa + u) / (1 - u)))


def bounds(storage: AnchorStorage, anchors: int, top_k: int, delta: float = BOUND_DELTA) -> dict[str, Any]:
    """The stated error bounds of a form (docs/receipts.md#compact-anchors): ``content_kappa`` and
    ``fields_roundoff`` for :func:`content_interval` (the projection's part holding with probability at least
    ``1 - delta`` for each layer's ``3 anchors k`` norms at once; None where ``m`` is too small for one), and ``coord_drift_abs``, the most the
    recomputed ``g0`` moves ``coord_drift``.

    >>> bounds(AnchorStorage("exact"), 1024, 8)
    {'delta': 0.01, 'content_kappa': 1.0, 'fields_roundoff': 0.0, 'coord_drift_abs': 0.0}
    """
    kappa: float | None = 1.0
    if storage.sketch_dim:
        lo, hi = norm_factors(storage.sketch_dim, 3 * anchors * top_k, delta)
        kappa = hi / lo if lo > 0 else None
    u_state = _UNIT_ROUNDOFF["float16"] if storage.compact else 0.0
    return {"delta": delta, "content_kappa": kappa, "fields_roundoff": _UNIT_ROUNDOFF[storage.fields_dtype],
            "coord_drift_abs": 2 * math.asin(u_state)}


def configured_storage(cfg: ReceiptsConfig, layout: list[tuple[int, int, int]], anchors: int) -> AnchorStorage:
    """The storage form ``receipts`` settings give a layout of routed layers ``(width, top_k, n_experts)``.

    >>> configured_storage(ReceiptsConfig(baseline_fields_dtype="float16"), [(64, 2, 8)], 64).form
    'half'
    """
    return choose_storage(layout, anchors, cfg.baseline_budget_bytes, cfg.seed, cfg.baseline_fields_dtype,
                          cfg.anchor_sketch_dim)
