"""Capture hooks: receipts computed inside the forward, per routed layer, on the model's device.

For each routed layer three forward hooks cooperate: the pre-norm's (x and g), the router's
(the model's own routing) and the MoE block's (its output). The block hook computes every
per-token quantity for the micro-batch, reduces it to per-window sums and counts, and drops
the per-token tensors before the next layer runs. Nothing is moved to the host until the
whole canary has been processed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from atlas_tracking.adapters.base import RoutedLayer, Routing
from atlas_tracking.artifacts.baseline import LayerReference
from atlas_tracking.artifacts.tensor_spool import TensorSpool
from atlas_tracking.engine.anchor_storage import AnchorStorage
from atlas_tracking.engine.combine import COMBINES, OWN, PATHS, UNFUSED, VERDICTS, arithmetic_key
from atlas_tracking.engine.fields import FieldEvaluator, LocalFields, field_evaluator
from atlas_tracking.engine.free_memory import field_rows
from atlas_tracking.engine.kernels import KERNEL_PATHS, PROCESS_KERNELS
from atlas_tracking.engine.pooled_competitors import CompetitorPool, PendingBatch
from atlas_tracking.engine.selfcheck import SelfCheck, same_tensor
from atlas_tracking.engine.sharding import gathered
from atlas_tracking.engine.transfer import read_back, send
from atlas_tracking.receipts.consistency import set_overlap
from atlas_tracking.receipts.coupling import state_rows, unit_rows, window_sums
from atlas_tracking.receipts.drift import (
    active_set_change,
    content_drift_per_token,
    js_divergence,
    one_minus_cos,
)
from atlas_tracking.receipts.field_chunk import random_distance
from atlas_tracking.receipts.geometry import angular, tangent_project
from atlas_tracking.receipts.occupancy import cell_keys, count_cells, sorted_cell_keys, window_loads
from atlas_tracking.receipts.sketch import project
from atlas_tracking.receipts.state1 import (
    NEAR_TIE_DTYPES,
    SetMargin,
    boundary_count,
    boundary_set_and_order,
    near_ties,
    set_margin,
    tie_scale,
)
from atlas_tracking.receipts.windows import COUNTERS
from atlas_tracking.schema.artifacts import DRIFT_RECEIPTS
from atlas_tracking.schema.config import ReceiptsConfig

_TOKEN_MEANS = ("margin_mean", "c2", "ov_cf", "d_adjacent_boundary", "d_adjacent_interior")
"""Pooled means over a micro-batch's tokens, reduced together (one masked sum per micro-batch)."""
_SUM_COUNT = (*_TOKEN_MEANS, "d_random_boundary")
"""Every pooled mean; ``d_random_boundary`` is taken at the boundary candidates, not every token."""
_TOKEN_COUNTERS = ("excluded_tokens", "rank_violations", "nonfinite_logits")
"""Counters of token masks; the rest of ``COUNTERS`` count boundary candidates and routes."""
_LAST_COUNTS = ("d_random_boundary.count", "no_random_competitor", "dropped_routes", "zero_expert_pairs")
"""The last rows of a layer's counts: candidates with a random competitor, those without one, dropped routes, and
the V2 pairs left out for a zero-computation expert on either side."""
_DRIFTCOUNTERS = ("anchors_changed", "anchors_changed_in_boundary")


FIELD_ROWS_BUDGET = 1 << 22
"""Elements of one ``[rows, d]`` tensor (16 MiB in fp32) up to which the fields of a micro-batch are
evaluated in a single call of the experts, however many rows that is."""
HASH_BITS = 24
_MISSING = object()


def field_carriers(layer: RoutedLayer, device: torch.device) -> torch.Tensor:
    """``[E]`` True for each expert of ``layer`` that carries a field: all but its zero-computation experts
    (docs/receipts.md#zero-computation-experts)."""
    carries = torch.ones(layer.num_experts, dtype=torch.bool, device=device)
    for expert in sorted(layer.zero_experts):  # each a fill on the device: no index tensor copied from the host
        carries[expert] = False
    return carries


def hash_uniform(seed: int, layer: int, window: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Deterministic integers uniform in ``[0, 2**24)`` from integer keys, the same on every device
    and for every sharding of the canary (a 32-bit multiply-xorshift hash in int64, no overflow).
    """
    h = (window * 73856093 + position * 19349663 + layer * 83492791 + (seed & 0xFFFF) * 2654435) & 0xFFFFFFFF
    for mult in (0x7FEB352D, 0x46B5D2A9):
        h = h ^ (h >> 15)
        h = (h * mult) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    return h >> (32 - HASH_BITS)


def random_competitor(
    scores: torch.Tensor, active: torch.Tensor, e_k1: torch.Tensor, draw: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random-e2 kill-shot: a uniform draw among all eligible experts outside R_t other than e_k1,
    wherever they are held.

    ``draw`` holds integers uniform in ``[0, 2**HASH_BITS)``. Returns the expert and whether one existed.
    """
    cand = torch.isfinite(scores).scatter(1, active, False).scatter(1, e_k1.view(-1, 1), False)
    n_cand = cand.sum(dim=1)
    j = (draw * n_cand) >> HASH_BITS
    pick = (cand.cumsum(dim=1) > j.view(-1, 1)).int().argmax(dim=1)
    return pick, n_cand > 0


@dataclass
class Selection:
    """One micro-batch's routing decision with its margins, boundary set and competitors."""

    routing: Routing
    native: Routing
    """The same routing in the router's own row order, padding rows included (what the self-check reads)."""
    sm: SetMargin
    in_b: torch.Tensor
    """``[N]`` boundary-set membership (``ceil(q T_w)`` smallest margins of each window)."""
    b_pos: torch.Tensor
    """Flat positions of a fixed number of boundary candidates per window."""
    e_rand: torch.Tensor
    """Random eligible competitor at each candidate (the random-e2 kill-shot)."""
    rand_ok: torch.Tensor
    """Candidate is in the boundary set and has a random competitor."""
    no_rand: torch.Tensor
    """Candidate is in the boundary set but no eligible expert is left to draw a random competitor from."""
    nonfinite: torch.Tensor


@dataclass(frozen=True)
class MicroBatch:
    """One forward call of a gate: canary windows ``[start, end)``, then padding up to ``size`` windows.

    Every call of a gate has ``size`` windows on every rank (a short last batch is padded with the
    canary's first windows, whose tokens are not measured), so layers whose dispatch needs the same
    shape on every rank run. ``keep=False`` marks a filler call: a rank with fewer micro-batches than
    another computes everything on windows ``[start, end)`` again, so that every collective (the
    layer's dispatch, parameter gathers, field exchanges) is matched, and keeps nothing of it.
    """

    start: int
    end: int
    size: int
    keep: bool = True


@dataclass
class AnchorBatch:
    """The canary anchors inside one micro-batch, routed through this checkpoint (docs/receipts.md#drift-between-checkpoints).

    For a baseline being collected, ``z`` is the current canonical state and ``experts`` the current
    active set; for drift, ``z`` is the baseline's ``z0`` and ``experts`` its ``R0``. Their fields
    are evaluated with the micro-batch's own fields (in its last call of the model's experts).
    """

    a0: int
    loc: torch.Tensor
    """Flat window-major positions of the anchors inside the micro-batch."""
    z: torch.Tensor
    g: torch.Tensor
    """``Gamma_now z`` in the model's dtype: the gate input the router and experts see."""
    routing: Routing
    experts: torch.Tensor
    collect: bool
    target: str = ""
    """Drift only: which reference it reads, ``""`` the baseline or ``"base."`` the post-training base."""
    """True: anchors of the baseline being collected; False: the baseline's anchors, for drift."""
    base: dict[str, torch.Tensor] | None = None
    """Drift only: the reference's rows of these anchors, read for this micro-batch and dropped with it."""


@dataclass
class FieldReceipts:
    """What a gate keeps of one micro-batch's expert fields: per-token reductions, in fp32."""

    c2: torch.Tensor
    c2_ok: torch.Tensor
    d_adj: torch.Tensor | None
    """``[N]`` redundancy distance of ``e_k`` and its adjacent competitor ``e_k1``; None (with ``jump`` and
    ``d_rand``) where the competitors wait for the layer's pooled call (``engine/pooled_competitors.py``)."""
    jump: torch.Tensor | None
    d_rand: torch.Tensor | None
    """``[M]`` redundancy distance of ``e_k`` and the random competitor, at the boundary candidates."""
    adj_fields: torch.Tensor
    """``[N]`` both ``e_k`` and ``e_k1`` carry a field (``d_adj`` and ``jump`` count only there)."""
    rand_fields: torch.Tensor
    """``[M]`` both ``e_k`` and the random competitor carry a field (``d_rand`` counts only there)."""
    anchors: list[torch.Tensor]
    """Tangent fields ``[A, k, d]`` of each anchor batch."""
    outs: dict[str, torch.Tensor]
    """``[N, d]`` the layer's routed output by each combine asked for (``engine/combine.py``), in the model's
    arithmetic and the hidden states' dtype."""
    sampled: tuple[torch.Tensor, ...] = ()
    """The fields of the self-check's sampled tokens (``SelfCheck.sample_groups``), where this micro-batch has them."""
    coupling: dict[str, torch.Tensor] = field(default_factory=dict)
    """Router-expert coupling of the micro-batch (docs/receipts.md#router-expert-coupling), where the router has rows:
    ``dot [W, E]`` per window the row-state dots, ``state`` and ``field`` ``[E, d]`` each expert's routed tokens'
    angular states and tangent fields summed."""


@dataclass
class Handed:
    """What the model handed its experts for the computed tokens (window-major): the combine's inputs."""

    weights: torch.Tensor
    index: torch.Tensor
    dtype: torch.dtype
    """The hidden states' dtype, which the model's combine returns."""


@dataclass
class LayerAccumulator:
    """Per-window sums and counts of one layer, on the device, for the whole canary."""

    n_windows: int
    window: int
    n_experts: int
    deltas: list[float]
    device: torch.device
    arrays: dict[str, torch.Tensor] = field(default_factory=dict)
    cells: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        w, e, d = self.n_windows, self.n_experts, self.device
        self.sum_names = [name + ".sum" for name in _SUM_COUNT]
        self.count_names = [
            *(name + ".count" for name in _TOKEN_MEANS), *(f"bm{i}.sum" for i in range(len(self.deltas))),
            *(f"near_tie.{name}" for name in NEAR_TIE_DTYPES), *_TOKEN_COUNTERS, *_LAST_COUNTS,
        ]
        self.sums = torch.zeros(len(self.sum_names), w, dtype=torch.float32, device=d)
        """``[S, W]`` per-window sums of every pooled mean, in ``sum_names`` order."""
        self.counts = torch.zeros(len(self.count_names), w, dtype=torch.int64, device=d)
        """``[C, W]`` per-window counts: the token masks of ``count_names`` first, then the candidate and route counts."""
        self.arrays["load"] = torch.zeros(w, e, dtype=torch.int64, device=d)
        self.arrays["p_mass"] = torch.zeros(w, e, dtype=torch.float32, device=d)
        self.arrays["jump"] = torch.full((w, self.window), float("nan"), dtype=torch.float32, device=d)
        self.arrays["margin"] = torch.full((w, self.window), float("nan"), dtype=torch.float32, device=d)
        self.arrays["align_dot"] = torch.zeros(w, e, dtype=torch.float32, device=d)
        self.drift: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """Per reference (``""`` the baseline, ``"base."`` the post-training base): ``[4, W]`` per-window sums of
        the drift functionals over anchors (``DRIFT_RECEIPTS`` order) and ``[6, W]`` counts (anchors counted per
        functional, then ``_DRIFTCOUNTERS``)."""

    def enable_drift(self, target: str = "") -> None:
        w, d = self.n_windows, self.device
        self.drift[target] = (torch.zeros(len(DRIFT_RECEIPTS), w, dtype=torch.float32, device=d),
                              torch.zeros(len(DRIFT_RECEIPTS) + len(_DRIFTCOUNTERS), w, dtype=torch.int64, device=d))
        self.sum_names += [target + name + ".sum" for name in DRIFT_RECEIPTS]
        self.count_names += [*(target + name + ".count" for name in DRIFT_RECEIPTS),
                             *(target + name for name in _DRIFTCOUNTERS)]

    def add_cells(self, active: torch.Tensor) -> None:
        """Keep this micro-batch's active-set keys; they are counted once, at the end of the gate."""
        self.cells.append(cell_keys(active, self.n_experts))

    def device_tensors(self) -> dict[str, torch.Tensor]:
        """What the host reads of this layer, still on the device (``engine/transfer.py`` copies a gate's at once):
        the per-window arrays, the stacked sums and counts, and the active-set keys of every kept token, in order."""
        return {
            **self.arrays,
            "sums": torch.cat([self.sums, *(d[0] for d in self.drift.values())]),
            "counts": torch.cat([self.counts, *(d[1] for d in self.drift.values())]),
            "cell_keys": (sorted_cell_keys(torch.cat(self.cells)) if self.cells
                          else torch.zeros(0, dtype=torch.int64, device=self.device)),
        }

    def from_host(self, read: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Per-window arrays as numpy from :meth:`device_tensors` read back, plus the active-set cells:
        ``(keys, counts)``, one key (or sorted row) per distinct active set (``occupancy.cell_keys``) and the tokens
        that visited it."""
        host: dict[str, Any] = {k: read[k].numpy() for k in self.arrays}
        for names, stack in zip((self.sum_names, self.count_names), (read["sums"], read["counts"])):
            host.update(zip(names, stack.numpy()))
        host["cells"] = count_cells(read["cell_keys"].numpy())
        return host


class LayerCapture:
    """The three hooks of one routed layer and the receipts they compute."""

    def __init__(
        self,
        layer: RoutedLayer,
        acc: LayerAccumulator,
        config: ReceiptsConfig,
        anchor_slices: dict[tuple[int, int], tuple[int, int, torch.Tensor]] | None = None,
        spool: TensorSpool | None = None,
        base: LayerReference | None = None,
        post_base: LayerReference | None = None,
        storage: AnchorStorage | None = None,
        index: int = 0,
        free_memory: int | None = None,
        pool_bytes: int | None = None,
    ):
        self.layer = layer
        self.acc = acc
        self.cfg = config
        self.anchor_slices = anchor_slices
        self.spool = spool
        """Where the anchors of the baseline being collected go (None: this gate collects none)."""
        self.collect = spool is not None
        self.index = index
        """The layer's index in the gate: its tensors' names in the baseline (``"{index}.z0"``, ...)."""
        self.free_memory = free_memory
        """Bytes free on the device when the gate started (None: unknown): bounds a chunked call's rows
        (``engine/free_memory.py``)."""
        self.pool = CompetitorPool(pool_bytes)
        """The kept micro-batches whose competitors wait for one pooled call (``engine/pooled_competitors.py``)."""
        self.last_batch: MicroBatch | None = None
        """The gate's last micro-batch, whose call of the experts evaluates what the pool holds (None: pool nothing)."""
        self.references = {"": base, "base.": post_base}
        """The anchors drift reads against: the baseline's and the post-training base's (None: not measured)."""
        self.storage = storage if storage is not None else AnchorStorage("exact")
        """How the anchors being collected are stored (docs/receipts.md#compact-anchors)."""
        self.evaluator: FieldEvaluator = field_evaluator(layer)
        self.carries = field_carriers(layer, acc.device)
        windows, positions = (torch.arange(n, device=acc.device) for n in (acc.n_windows, acc.window))
        self.draws = hash_uniform(config.seed, layer.ordinal, windows.view(-1, 1), positions.view(1, -1)).int()
        """``[W, L]`` the random competitor's draw at every (window, position) of the canary."""
        self.collected: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.gamma0: torch.Tensor | None = None
        """The norm's gain, read inside the forward (where sharded parameters are gathered)."""
        self.beta0: torch.Tensor | None = None
        """A LayerNorm's bias, read with the gain (None: the norm has none)."""
        self.rows: torch.Tensor | None = None
        """``[E, d]`` the router's rows in state space, read at the layer's first call (None: none to read)."""
        self.unit: torch.Tensor | None = None
        """``rows`` each over its length."""
        self._rows_read = False
        self.means_fields = self.collect or any(ref is not None for ref in (base, post_base))
        """Whether this gate sums each expert's fields: a baseline keeps their means, a gate against one compares."""
        self.coupling: dict[str, torch.Tensor] = {}
        """``state`` and ``field``: ``[E, d]`` sums over the kept tokens routed to each expert of their angular states
        and of its tangent fields (docs/receipts.md#router-expert-coupling)."""
        for target, tensors in self.references.items():
            if tensors is not None:
                acc.enable_drift(target)
        self.batch = MicroBatch(0, 0, 0)
        self._x: torch.Tensor | None = None
        self._g: torch.Tensor | None = None
        self._router_out: Any = None
        self._stash: tuple[Selection, list[AnchorBatch], FieldReceipts] | None = None
        self._own_forward: Any = None
        self._context: Any = None
        self.fused = config.fuse_experts and layer.fusable
        self.combine: str | None = None if self.fused else UNFUSED
        """How this layer's output comes about in this gate (``engine/combine.py``); chosen at its first call, from
        the verdict of an earlier gate of this process with the same arithmetic where there is one."""
        acc.arrays["layer_output"] = torch.full((acc.n_windows,), PATHS.index(UNFUSED), dtype=torch.int64,
                                                device=acc.device)
        acc.arrays["kernels"] = torch.zeros(acc.n_windows, dtype=torch.int64, device=acc.device)
        """Per window, the path of this layer's field arithmetic (``KERNEL_PATHS``; docs/receipts.md#field-kernels)."""
        self.check = SelfCheck(layer, acc)
        self._zero3 = any(hasattr(p, "ds_status") for m in (layer.norm, layer.router, layer.block) for p in m.parameters())
        """Whether any parameter the hooks read is ZeRO-3 managed (else :meth:`_parameters` gathers nothing)."""
        self._handles: list[Any] = []
        self._autocast: tuple[str, bool, torch.dtype] = ("cpu", False, torch.bfloat16)
        self.calls = 0

    # --- precision ---------------------------------------------------------------------------
    def _own_arithmetic(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Atlas's arithmetic in fp32 whatever autocast the model runs under (docs/receipts.md#precision);
        the model's own modules are called back inside :meth:`_model_arithmetic`."""
        self._autocast = (device.type, torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
        return torch.autocast(device.type, enabled=False) if self._autocast[1] else contextlib.nullcontext()

    def rank_violations(self, sm: SetMargin, dtype: torch.dtype) -> torch.Tensor:
        """Tokens whose model choice is beaten by an unselected expert by more than the rounding of the precision
        the model selected in (its gate input's dtype, or its autocast dtype): ``m < -eps (|s_k| + |s_k1|)``.
        A model that ranks in bf16 may pick either of two scores that differ below its rounding."""
        _, enabled, autocast = self._autocast
        eps = max(torch.finfo(t).eps for t in (dtype, *((autocast,) if enabled else ())))
        return sm.margin < -eps * tie_scale(sm)

    def _model_arithmetic(self) -> contextlib.AbstractContextManager:
        """The autocast context the model's forward ran in, for calls of its own modules from a hook."""
        device_type, enabled, dtype = self._autocast
        return torch.autocast(device_type, dtype=dtype) if enabled else contextlib.nullcontext()

    # --- hook plumbing -------------------------------------------------------------------------
    def attach(self) -> None:
        self._handles = [
            self.layer.norm.register_forward_hook(self._on_norm),
            self.layer.router.register_forward_hook(self._on_router),
            self.layer.block.register_forward_hook(self._on_block),
        ]
        if type(self.layer).seed_router is not RoutedLayer.seed_router:  # a router that draws random numbers
            self._handles.append(self.layer.router.register_forward_pre_hook(self._before_router))
        self._context = self.layer.gate_context()
        self._context.__enter__()
        if self.fused:
            experts = self.layer.experts
            self._own_forward = experts.__dict__.get("forward", _MISSING)
            self.layer.experts_forward = experts.forward
            experts.forward = self._fused_experts

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None
        if self.fused and self._own_forward is not None:
            experts = self.layer.experts
            if self._own_forward is _MISSING:
                del experts.forward
            else:
                experts.forward = self._own_forward
            self._own_forward = None
            self.layer.experts_forward = None
        self._x = self._g = self._router_out = self._stash = None

    def _parameters(self) -> Any:
        """The norm's and router's parameters gathered while the hooks read them outside their own forward;
        at the gate's first call the whole block's, whose experts and shared experts the self-check evaluates
        there (every rank makes that call, so a ZeRO-3 gather is matched on every rank)."""
        if not self._zero3:
            return contextlib.nullcontext()
        return gathered([self.layer.norm, self.layer.router] + ([self.layer.block] if self.calls == 0 else []))

    def _on_norm(self, module, inputs, output) -> None:
        self._x, self._g = inputs[0], output

    def _before_router(self, module, inputs) -> None:
        """Seed the router's random draws from the micro-batch (docs/distributed.md#random-routing): its windows
        and this layer, never the order in which a rank runs its micro-batches."""
        start, end = torch.tensor(self.batch.start), torch.tensor(self.batch.end)
        self.layer.seed_router(int(hash_uniform(self.cfg.seed, self.layer.ordinal, start, end)))

    def _on_router(self, module, inputs, output) -> None:
        self._router_out = output

    def _on_block(self, module, inputs, output) -> None:
        if self._x is None or self._router_out is None:
            raise RuntimeError(f"{self.layer.name}: the norm or router hook did not fire before the MoE block")
        try:
            out = self.layer.block_output(output)
            with self._parameters():
                with self._own_arithmetic(out.device):
                    sel, _, fr = self.compute(self._x, self._g, self._router_out, out, self._stash)
                if self.batch.keep:  # the model's own modules, in the model's autocast context
                    self.check.observe(self._x, self._g, inputs[0] if inputs else None, sel.native, out,
                                       (self.batch.start, self.batch.end), self.batch.size, fr.sampled)
        finally:
            self._x = self._g = self._router_out = self._stash = None
        self.calls += 1

    def _fused_experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       *args: Any, **kwargs: Any) -> torch.Tensor:
        """Stand-in for the experts' forward during a gate: the model's own experts evaluate the active set,
        the adjacent and the random competitors (and the anchors) in as many calls as keep each within the
        forward's own expert rows (in one pass where the adapter reads the experts' own products), and the active
        fields are reduced to the receipts.

        The output is the model's own, bit for bit: at the layer's first call under an arithmetic this process has
        not seen (``combine.arithmetic_key``) the experts' own forward runs too, and a combine of the active fields
        is kept only if it equals that output exactly; otherwise every call returns the experts' own forward, as
        does a call with padding rows (whose fields are not evaluated; docs/receipts.md#precision).
        """
        self.check.experts_call(hidden_states, top_k_index, top_k_weights)
        own, key = None, None
        padded = hidden_states.shape[0] != self.n_windows * self.acc.window
        if self.combine is None and self.layer.expert_placement() is None:  # an EP group decides together
            key = arithmetic_key(self.layer.experts_forward, self.layer.experts, hidden_states, top_k_index,
                                 top_k_weights)
            self.combine = VERDICTS.get(self.layer.experts, key)
        if self.combine in (None, OWN) or padded:  # padding rows have no fields: the model's own call
            own = self.layer.experts_forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        combines = tuple(COMBINES) if self.combine is None else () if self.combine == OWN else (self.combine,)
        with torch.no_grad(), self._parameters(), self._own_arithmetic(hidden_states.device):
            sel = self.select(self._router_out, hidden_states)
            x2 = self.window_major(self._x)
            zh = self.layer.direction(x2)
            anchors = self.anchor_batches(x2, hidden_states.dtype)
            handed = Handed(self.measured(top_k_weights), self.measured(top_k_index).long(), hidden_states.dtype)
            g2 = self.measured(hidden_states)
            fields = self.fields(sel, g2, zh, anchors, handed, combines, self._samples(sel, (g2, handed.index)))
            self._stash = (sel, anchors, fields)
            if self.combine is None:
                self.combine = self._first_combine(fields.outs, self.measured(own))
                if key is not None:
                    VERDICTS.put(self.layer.experts, key, self.combine)
        if self.batch.keep:
            self.acc.arrays["layer_output"][self.batch.start : self.batch.end] = PATHS.index(self.combine)
        if own is not None:
            return own
        out = fields.outs[self.combine]  # window-major: back to the native row order
        index = self.token_index(out.device)
        return out if index is None else torch.empty_like(out).index_copy_(0, index, out)

    def _first_combine(self, outs: dict[str, torch.Tensor], own: torch.Tensor) -> str:
        """The first combine equal to the model's own output bit for bit, else ``OWN``; under expert parallelism
        every rank of the group takes the same (one host sync per layer and gate)."""
        ok = torch.tensor([bool(torch.equal(outs[name], own)) for name in COMBINES], dtype=torch.int64)
        placement = self.layer.expert_placement()
        if placement is not None:
            ok = ok.to(own.device)
            torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN, group=placement[0])
        return next((name for name, good in zip(COMBINES, ok.tolist()) if good), OWN)

    # --- receipts ---------------------------------------------------------------------------
    @property
    def n_windows(self) -> int:
        """Canary windows this forward call computes (padding excluded)."""
        return self.batch.end - self.batch.start

    def token_index(self, device: torch.device) -> torch.Tensor | None:
        """Native flat index of each computed window-major token; None when they are the first rows in order
        (batch-first layers: padding windows come last)."""
        if not self.layer.sequence_first:
            return None
        seq = self.acc.window
        return (torch.arange(seq, device=device).view(1, -1) * self.batch.size
                + torch.arange(self.n_windows, device=device).view(-1, 1)).reshape(-1)

    def measured(self, flat: torch.Tensor) -> torch.Tensor:
        """The computed tokens of a flat native ``[size * L, ...]`` tensor, window-major."""
        index = self.token_index(flat.device)
        return flat[: self.n_windows * self.acc.window] if index is None else flat.index_select(0, index)

    def window_major(self, t: torch.Tensor) -> torch.Tensor:
        """A ``[B, L, d]`` (or ``[L, B, d]`` for sequence-first layers) tensor as window-major ``[N, d]``."""
        return self.measured(t.reshape(-1, t.shape[-1]))

    def select(self, router_out: Any, g_native: torch.Tensor) -> Selection:
        """Routing, set margins, boundary set and competitors of one micro-batch, in window-major order.

        ``g_native`` is the flattened gate input in the order the router saw it.
        """
        layer, cfg = self.layer, self.cfg
        w0, bw, seq = self.batch.start, self.n_windows, self.acc.window
        native = layer.routing(router_out, g_native)
        nonfinite = ~torch.isfinite(layer.router_logits(router_out, native).abs().amax(dim=-1))  # NaN propagates
        routing = Routing(**{k: (self.measured(v) if isinstance(v, torch.Tensor) else v)
                             for k, v in vars(native).items()})
        nonfinite = self.measured(nonfinite)
        sm = set_margin(routing.scores, routing.active)
        in_b, order = boundary_set_and_order(sm.margin.view(bw, seq), sm.valid.view(bw, seq), cfg.boundary_q)
        # boundary candidates: a fixed number per window (no host sync); in_b masks the real set
        local_pos = order[:, : max(1, boundary_count(seq, cfg.boundary_q))]
        b_pos = (local_pos + torch.arange(0, bw * seq, seq, device=g_native.device).view(-1, 1)).reshape(-1)
        draws = self.draws.to(b_pos.device)[w0 : w0 + bw].reshape(-1).index_select(0, b_pos)
        e_rand, has_rand = random_competitor(
            routing.scores.index_select(0, b_pos), routing.active.index_select(0, b_pos),
            sm.e_k1.index_select(0, b_pos), draws)
        cand_in_b = in_b.reshape(-1).index_select(0, b_pos)
        return Selection(
            routing=routing, native=native, sm=sm, in_b=in_b.reshape(-1), b_pos=b_pos, e_rand=e_rand,
            rand_ok=cand_in_b & has_rand, no_rand=cand_in_b & ~has_rand, nonfinite=nonfinite,
        )

    def _samples(self, sel: Selection, handed: tuple[torch.Tensor, torch.Tensor] | None
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The self-check's sampled (rows, experts) where this micro-batch holds the canary's first window (the norm's
        output at the adapter's active sets; ``handed``: the experts' input and the model's indices), else none."""
        if self.batch.start != 0 or not self.batch.keep:
            return []
        return self.check.sample_groups(self.window_major(self._g), sel.routing.active, handed)

    def anchor_batches(self, x2: torch.Tensor, dtype: torch.dtype) -> list[AnchorBatch]:
        """The anchors this micro-batch holds, for the baseline being collected and for drift (in that order)."""
        drifts = [(t, ref) for t, ref in self.references.items() if ref is not None]
        if self.anchor_slices is None or not self.batch.keep or not (self.collect or drifts):
            return []
        a0, a1, loc = self.anchor_slices[(self.batch.start, self.batch.end)]
        if a1 <= a0:
            return []
        out = []
        if self.collect:
            z = self.storage.round_state(self.layer.normalize(x2.index_select(0, loc)))  # what the baseline keeps
            g = self.layer.gain(z).to(dtype)
            with self._model_arithmetic():
                routing = self.layer.route(g)
            out.append(AnchorBatch(a0, loc, z, g, routing, routing.active, collect=True))
        for target, ref in drifts:
            rows = send(ref.rows(a0, a1), x2.device)  # this layer's rows of this micro-batch only, in one copy
            z0 = rows["z0"].float()
            g = self.layer.gain(z0).to(dtype)  # transport: Gamma_j z0 (+ beta_j)
            with self._model_arithmetic():
                routing = self.layer.route(g)
            out.append(AnchorBatch(a0, loc, z0, g, routing, rows["R0"], collect=False, target=target, base=rows))
        return out

    def _pair_call(self, groups: list[tuple[torch.Tensor, torch.Tensor]], like: torch.Tensor) -> list[torch.Tensor]:
        """One call of the field evaluator for groups of (rows ``[R, d]``, experts ``[R, m]``): each row through
        each of its experts, written once into one buffer. Returns ``[R, m, d]`` per group. With no groups the
        call is empty (it keeps an expert-parallel group's exchanges in step); ``like`` gives width and dtype."""
        if not groups:
            with self._model_arithmetic():
                self.evaluator(like.new_empty((0, like.shape[-1])), torch.zeros(0, dtype=torch.long, device=like.device))
            return []
        sizes = [e.numel() for _, e in groups]
        first = groups[0][0]
        rows_all = first.new_empty((sum(sizes), first.shape[-1]))
        for (rows, experts), part in zip(groups, torch.split(rows_all, sizes)):
            part.view(*experts.shape, -1).copy_(rows.unsqueeze(1).expand(*experts.shape, rows.shape[-1]))
        idx_all = torch.cat([e.reshape(-1) for _, e in groups])
        with self._model_arithmetic():
            u = torch.split(self.evaluator(rows_all, idx_all), sizes)
        return [part.view(*experts.shape, -1) for part, (_, experts) in zip(u, groups)]

    def _grouped_call(self, hidden: torch.Tensor, index: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]]
                      ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """The active fields of the model's experts call (``hidden``, ``index``) as the products its own experts code
        sums, with the fields of further ``pairs`` (groups as in :meth:`_pair_call`), where the layer's adapter reads
        them so (``RoutedLayer.grouped_outputs``) and every expert is held here; None otherwise."""
        if not isinstance(self.evaluator, LocalFields):
            return None
        with self._model_arithmetic():
            return self.layer.grouped_outputs(hidden, index, pairs)

    def _pools(self, device: torch.device) -> bool:
        """Whether this micro-batch's competitors wait for the layer's pooled call (``engine/pooled_competitors.py``):
        a kept micro-batch on the CPU, with eager field arithmetic (the pooled distances are eager), a memory budget,
        the gate's last micro-batch known, no ZeRO-3 parameters (whose gathers every rank must match), and experts
        whose adapter pools them (``RoutedLayer.pools_pairs``)."""
        return (device.type == "cpu" and self.batch.keep and self.pool.budget is not None
                and self.last_batch is not None and not self._zero3
                and PROCESS_KERNELS.path(self.cfg.kernels, device) == "eager" and self.layer.pools_pairs())

    def _flush_pool(self) -> None:
        """The pooled competitors' products, in one call of the experts in the model's arithmetic, reduced into the
        layer's per-window sums (inside the model's forward, where its parameters are what its own call reads)."""
        def evaluate(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
            with self._model_arithmetic():
                fields = self.layer.grouped_pair_outputs(pairs)
            if fields is None:
                raise RuntimeError(f"{self.layer.name}: the pooled competitors' experts call read nothing")
            return fields

        self.pool.flush(evaluate, self.acc, self.cfg.eps_d)

    def _anchor_calls(self, anchors: list[AnchorBatch], like: torch.Tensor) -> list[torch.Tensor]:
        """Each anchor batch's fields in a call of its own, so a baseline's anchors and the same anchors read at a
        later gate go through calls with the same rows: parts that did not change drift by exactly 0, whatever
        the rest of the micro-batch. Every rank makes one call per reference a gate collects or reads (empty
        where a micro-batch holds no anchors), so an expert-parallel group's exchanges stay in step."""
        targets = 0 if self.anchor_slices is None else int(self.collect) + sum(
            ref is not None for ref in self.references.values())
        fields = [self._pair_call([(a.g, a.experts)], like)[0] for a in anchors]
        for _ in range(targets - len(anchors)):
            self._pair_call([], like)
        return fields

    def fields(self, sel: Selection, g2: torch.Tensor, zh: torch.Tensor, anchors: list[AnchorBatch],
               handed: Handed | None = None, combines: tuple[str, ...] = (),
               sample: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> FieldReceipts:
        """Evaluate the fields a gate needs and reduce them per token, chunk by chunk.

        Per token: the active set and the adjacent competitor; at the boundary candidates, the random
        competitor; and each anchor batch's experts (in calls of their own, see :meth:`_anchor_calls`). A chunked
        call of the field evaluator holds at most
        ``token_chunk`` tokens (default: ``N k / 2`` rows, half the forward's own (token, expert) pairs,
        since a call materialises its input and output rows; at least ``FIELD_ROWS_BUDGET / d`` rows,
        so narrow models make one call; and within a share of the memory free when the gate started,
        ``engine/free_memory.py``), and only per-token reductions outlive it: State2 comes from
        the Gram matrix of the tangent fields, the distances and the jump from three ``[N, d]`` fields
        (tangent projection is linear). The evaluator sets the number of calls (under expert
        parallelism, the largest any rank of the group needs; the extra calls are empty).

        With ``handed`` (the gate stands in for the experts' call), the active set is evaluated first, in one
        call holding the rows of the model's own call in its order (so each expert's matmul sees the inputs it
        sees in the model's call), and each of ``combines`` builds the layer's output from those fields in
        the model's arithmetic; the chunked calls then hold the competitors only. The self-check's ``sample``
        groups ride in the last chunked call, with the random competitors. Where the adapter reads the experts'
        own products (:meth:`_grouped_call`), the active fields are those products, and when a single chunk holds
        every token its competitors and sample come in the same pass; on the CPU the competitors then wait for
        the layer's pooled call instead (:meth:`_pools`), and the sample comes with the active set.
        """
        cfg, routing = self.cfg, sel.routing
        n, k = routing.active.shape
        d, dev = g2.shape[-1], g2.device
        chosen = sel.sm.e_k1.view(-1, 1) if handed is not None else torch.cat([routing.active, sel.sm.e_k1.view(-1, 1)], 1)
        s_active = routing.scores.gather(1, routing.active)
        pos_k = s_active.argmin(dim=1)
        rho, rho_k = routing.rho, routing.rho.gather(1, pos_k.view(-1, 1)).squeeze(1)
        carries = self.carries.to(dev)
        active_fields = carries[routing.active]  # zero-computation experts carry no field: no pairs, no distances
        extra = [(g2.index_select(0, sel.b_pos), sel.e_rand.view(-1, 1)), *(sample or [])]
        width = k + 1 if handed is None else 1  # rows per token in a chunked call
        per_call = cfg.token_chunk or max(1, max(n * k // 2, FIELD_ROWS_BUDGET // d) // width)
        affordable = field_rows(self.free_memory, d, g2.element_size())
        if cfg.token_chunk is None and affordable is not None:
            per_call = max(1, min(per_call, affordable // width))
        c2, d_adj, jump = (torch.empty(n, device=dev) for _ in range(3))
        c2_ok = torch.empty(n, dtype=torch.bool, device=dev)
        v_k = torch.empty(n, d, device=dev)
        wanted = -(-n // per_call)
        active_u, joint, outs = None, None, {}
        pooled = handed is not None and wanted == 1 and self._pools(dev)
        if handed is not None:
            further = (sample or []) if pooled else [(g2, chosen), *extra] if wanted == 1 else []
            grouped = self._grouped_call(g2, handed.index, further)
            if grouped is None:
                pooled = False  # the competitors come in the chunked calls
                (active_u,) = self._pair_call([(g2, handed.index)], g2)
            else:
                active_u, joint = grouped[0], grouped[1] or None
            outs = {name: COMBINES[name](active_u, handed.weights, handed.index, handed.dtype) for name in combines}
            if not same_tensor(handed.index, routing.active):
                # the active fields stay in the model's slot order; the adapter's per-expert values follow them
                # there (C2 sums over pairs, the routed field over experts: neither depends on the order)
                at = (handed.index.unsqueeze(2) == routing.active.unsqueeze(1)).int().argmax(dim=2)
                s_active, rho, active_fields = (t.gather(1, at) for t in (s_active, rho, active_fields))
                pos_k = (handed.index == sel.sm.e_k.view(-1, 1)).int().argmax(dim=1)
        slot_experts = routing.active if handed is None else handed.index
        unit = self._unit_rows(dev)
        sum_fields = unit is not None and self.means_fields
        f_sum = torch.zeros(self.layer.num_experts, d, dtype=torch.float64, device=dev)
        paths: set[str] = set()
        for call in range(self.evaluator.calls(wanted)):
            if call >= wanted:
                self._pair_call([], g2)
                continue
            t0, t1 = call * per_call, min(n, (call + 1) * per_call)
            asked = chosen[t0:t1]
            # pooled: no adjacent or random fields here, only the sample's with the active set (``joint``)
            u_groups = [None, None, *(joint or [])] if pooled else (
                joint or self._pair_call([(g2[t0:t1], asked), *(extra if t1 == n else [])], g2))
            u_active = u_groups[0][:, :k] if active_u is None else active_u[t0:t1]  # the model's dtype
            part, path = PROCESS_KERNELS(
                cfg.kernels, u_active, None if pooled else u_groups[0][:, -1], zh[t0:t1], rho[t0:t1],
                s_active[t0:t1], active_fields[t0:t1], pos_k[t0:t1], rho_k[t0:t1], cfg.beta_adj, cfg.eps_kappa,
                cfg.eps_d, slot_experts[t0:t1] if sum_fields else None, self.layer.num_experts)
            paths.add(path)
            c2[t0:t1], c2_ok[t0:t1], v_k[t0:t1] = part[:3]
            if not pooled:
                d_adj[t0:t1], jump[t0:t1] = part.d_adj, part.jump
            if part.field_sum is not None:
                f_sum += part.field_sum
            if t1 == n:
                u_rand, *sampled = u_groups[1:]
        if self.batch.keep:  # eager where any chunk was
            self.acc.arrays["kernels"][self.batch.start : self.batch.end] = min(map(KERNEL_PATHS.index, paths))
        u_anchors = self._anchor_calls(anchors, g2)
        e_k = sel.sm.e_k
        adj_fields = carries[e_k] & carries[sel.sm.e_k1]
        rand_fields = carries[e_k.index_select(0, sel.b_pos)] & carries[sel.e_rand]
        d_rand = None
        if pooled:
            in_b, keep_adj = sel.in_b, sel.sm.valid & adj_fields
            self.pool.add(PendingBatch(
                rows=slice(self.batch.start, self.batch.end), window=self.acc.window,
                adjacent=(g2, chosen), random=extra[0], zh=zh, v_k=v_k, field=part.field, rho_k=rho_k,
                b_pos=sel.b_pos, boundary=in_b & adj_fields, interior=keep_adj & ~in_b,
                rand_ok=sel.rand_ok & rand_fields))
            d_adj = jump = None
        else:
            d_rand = random_distance(u_rand.reshape(-1, d), zh, v_k, sel.b_pos, cfg.eps_d)
        if self.pool.pending and (self.batch is self.last_batch or self.pool.full()):
            self._flush_pool()
        return FieldReceipts(
            c2=c2, c2_ok=c2_ok, d_adj=d_adj, jump=jump, d_rand=d_rand, adj_fields=adj_fields, rand_fields=rand_fields,
            anchors=[tangent_project(u_a.float(), angular(a.z)) for a, u_a in zip(anchors, u_anchors)],
            outs=outs, sampled=tuple(sampled),
            coupling={} if unit is None else dict(zip(("dot", "state"), window_sums(zh, routing.active, unit,
                                                                                    self.n_windows)),
                                                  **({"field": f_sum} if self.means_fields else {})),
        )

    @torch.no_grad()
    def compute(self, x: torch.Tensor, g: torch.Tensor, router_out: Any, out: torch.Tensor,
                stash: tuple[Selection, list[AnchorBatch], FieldReceipts] | None = None
                ) -> tuple[Selection, list[AnchorBatch], FieldReceipts]:
        """Reduce one micro-batch of this layer to per-window sums (x, g, out are ``[B, L, d]``); returns its
        routing decision, anchors and field receipts."""
        layer, acc = self.layer, self.acc
        w0, w1 = self.batch.start, self.batch.end
        bw, seq = w1 - w0, acc.window
        d = x.shape[-1]
        if self.gamma0 is None:  # kept on the device, read back with the gate's results
            self.gamma0 = layer.gamma().detach().float().clone()
            beta = layer.beta()
            self.beta0 = None if beta is None else beta.detach().clone()
        x2, g2, out2 = self.window_major(x), self.window_major(g), self.window_major(out)
        if stash is None:
            sel = self.select(router_out, g.reshape(-1, d))
            zh = self.layer.direction(x2)  # the direction of z: the norm's positive scale cancels
            anchors = self.anchor_batches(x2, g2.dtype)
            stash = (sel, anchors, self.fields(sel, g2, zh, anchors, sample=self._samples(sel, None)))
        sel, anchors, fr = stash
        if not self.batch.keep:
            return stash
        routing, sm, in_b = sel.routing, sel.sm, sel.in_b
        valid = sm.valid

        # routing self-consistency: re-route the post-update state through the same norm and router
        with self._model_arithmetic():
            post = layer.route_active(layer.norm.forward(x2 + out2))
        ov = set_overlap(routing.active, post, layer.num_experts)

        # every per-window sum and count of the micro-batch: a masked sum over tokens, one over candidates
        rows, arr = slice(w0, w1), acc.arrays
        in_b_adj = in_b & fr.adj_fields
        n_means, n_masks = len(_TOKEN_MEANS), len(acc.counts) - len(_LAST_COUNTS)
        tokens = torch.stack([
            valid, fr.c2_ok, torch.ones_like(valid), in_b_adj, valid & ~in_b & fr.adj_fields,  # _TOKEN_MEANS
            *((sm.margin <= delta) & valid for delta in acc.deltas),
            *near_ties(sm, NEAR_TIE_DTYPES.values()),
            ~valid, self.rank_violations(sm, g.dtype) & valid, sel.nonfinite,  # _TOKEN_COUNTERS
            valid & ~fr.adj_fields,  # zero-expert pairs at the adjacent competitor
        ]).view(n_masks + 1, bw, seq)
        rand_ok = sel.rand_ok & fr.rand_fields
        candidates = torch.stack([rand_ok, sel.no_rand, sel.rand_ok & ~fr.rand_fields]).view(3, bw, -1)  # window-major
        # where the competitors wait for the pooled call, their distances and jump are added there (0 here)
        d_adj = torch.zeros_like(sm.margin) if fr.d_adj is None else fr.d_adj
        d_rand = torch.zeros_like(sel.b_pos, dtype=torch.float32) if fr.d_rand is None else fr.d_rand
        values = torch.stack([sm.margin, fr.c2, ov, d_adj, d_adj]).float().view(n_means, bw, seq)
        acc.sums[:, rows] += torch.cat([torch.where(tokens[:n_means], values, 0.0).sum(-1),
                                        torch.where(candidates[0], d_rand.view(bw, -1), 0.0).sum(1, keepdim=True).T])
        n_tok, n_cand = tokens.sum(-1), candidates.sum(-1)
        dropped = (torch.zeros_like(n_cand[:1]) if routing.dropped is None
                   else routing.dropped.reshape(1, bw, -1).sum(-1))
        acc.counts[:, rows] += torch.cat([n_tok[:n_masks], n_cand[:2], dropped, n_tok[n_masks:] + n_cand[2:]])
        if fr.jump is not None:
            arr["jump"][rows] = torch.where(in_b_adj, fr.jump, float("nan")).view(bw, seq)
        arr["load"][rows] += window_loads(routing.active, bw, layer.num_experts)
        arr["p_mass"][rows] += routing.probs.view(bw, seq, -1).sum(1)
        arr["margin"][rows] = torch.where(valid, sm.margin, float("nan")).view(bw, seq)
        acc.add_cells(routing.active)
        self._add_coupling(fr, rows)
        for a, v_a in zip(anchors, fr.anchors):
            if a.collect:
                self._collect(a, v_a, g2, in_b)
            else:
                self._drift(a, v_a, g2, x2)
        return stash

    def _unit_rows(self, device: torch.device) -> torch.Tensor | None:
        """The router's unit rows in state space, read at the layer's first call of a gate, where a sharded router's
        parameters are gathered (docs/receipts.md#router-expert-coupling); None when the router holds none to read."""
        if not self._rows_read:
            self._rows_read = True
            weight = self.layer.router_rows()
            if weight is not None:
                self.rows = state_rows(weight.to(device), self.layer.gamma().detach().to(device),
                                       self.layer.norm_type == "layernorm")
                self.unit = unit_rows(self.rows)
        return self.unit

    def _add_coupling(self, fr: FieldReceipts, rows: slice) -> None:
        """Add one kept micro-batch's coupling to the gate's: its windows' row-state dots, and per expert the states
        and fields of its routed tokens."""
        if not fr.coupling:
            return
        self.acc.arrays["align_dot"][rows] = fr.coupling["dot"]
        for key in ("state", "field"):
            if key in fr.coupling:
                part = fr.coupling[key]
                self.coupling[key] = part if key not in self.coupling else self.coupling[key] + part

    def _collect(self, a: AnchorBatch, u: torch.Tensor, g2: torch.Tensor, in_b: torch.Tensor) -> None:
        """Keep one anchor batch in the storage form (docs/receipts.md#compact-anchors): compact forms keep ``z0``
        and ``p0`` in float16 (``a.z`` is already rounded, and routed and evaluated as rounded) and no ``g0``."""
        st = self.storage
        tensors = {"z0": a.z.to(torch.float16) if st.compact else a.z, "R0": a.routing.active,
                   "p0": a.routing.probs.to(torch.float16) if st.compact else a.routing.probs,
                   "u0": st.store_fields(u), "b0": in_b[a.loc].to(torch.uint8)}  # b0 as the baseline file keeps it
        if not st.compact:
            tensors["g0"] = g2[a.loc].float()
        self.collected.append((a.a0, tensors))
        if a.z.device.type == "cpu":  # already on the host: spooled at once; from a device, at the micro-batch's end
            self.spool_rows(self.collected)

    def spool_rows(self, collected: list[tuple[int, dict[str, torch.Tensor]]]) -> None:
        """Move anchor rows this layer collected (``collected``, on the host) to the spool and let them go."""
        assert self.spool is not None
        for a0, part in collected:
            for key, rows in part.items():
                self.spool.add(f"{self.index}.{key}", a0, rows)
        self.collected = []

    def _drift(self, a: AnchorBatch, u1: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor) -> None:
        ref, base = self.references[a.target], a.base
        u0 = base["u0"]
        if ref.sketch is not None:  # projected exactly as the base fields were
            u1 = project(u1, ref.sketch)
        u1 = u1.to(u0.dtype).float()  # compare at the baseline's storage precision
        changed = active_set_change(base["R0"], a.routing.active)
        fields = self.carries.to(u1.device)[base["R0"].long()] if self.layer.zero_experts else None
        content = content_drift_per_token(u1, u0.float(), self.cfg.eps_d, self.cfg.content_quantile, fields)
        has_field = torch.ones_like(changed, dtype=torch.bool) if fields is None else fields.any(dim=1)
        values = torch.stack([
            one_minus_cos(*self._gate_inputs(base, ref, g2, x2, a.loc)),  # DRIFT_RECEIPTS order
            changed,
            js_divergence(base["p0"], a.routing.probs.to(base["p0"].dtype)),  # at the stored precision
            torch.where(has_field, content, 0.0),
        ]).float()
        win = torch.div(a.loc, self.acc.window, rounding_mode="floor") + self.batch.start
        moved = (changed > 0).long()
        counts = torch.stack([*(torch.ones_like(moved),) * (len(DRIFT_RECEIPTS) - 1), has_field.long(), moved,
                              moved * base["b0"].long()])
        sums, totals = self.acc.drift[a.target]
        sums.index_add_(1, win, values)
        totals.index_add_(1, win, counts)

    def _gate_inputs(self, base: dict[str, torch.Tensor], ref: LayerReference, g2: torch.Tensor,
                     x2: torch.Tensor, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate inputs ``coord_drift`` compares: the stored ``g0`` and the forward's own, or, where a compact
        baseline keeps no ``g0``, ``gamma0 z0 (+ beta0)`` and the same gain of the state rounded as ``z0`` was."""
        if "g0" in base:
            return base["g0"], g2[loc]
        z1 = self.layer.normalize(x2.index_select(0, loc)).to(base["z0"].dtype).float()
        g0 = ref.gamma0 * base["z0"].float()
        return (g0 if ref.beta0 is None else g0 + ref.beta0), self.layer.gain(z1)


def merge_hosts(hosts: list[dict[str, Any]], owned: list[np.ndarray]) -> dict[str, Any]:
    """Merge one layer's host arrays from several processes, each owning disjoint windows."""
    if len(hosts) == 1:
        return hosts[0]
    merged: dict[str, Any] = {}
    for key in hosts[0]:
        if key == "cells":
            parts = [h["cells"] for h in hosts if len(h["cells"][0])] or [hosts[0]["cells"]]
            distinct, which = np.unique(np.concatenate([keys for keys, _ in parts]), axis=0, return_inverse=True)
            counts = np.bincount(which.reshape(-1), weights=np.concatenate([c for _, c in parts]),
                                 minlength=len(distinct))
            merged["cells"] = (distinct, counts.astype(np.int64))
            continue
        out = hosts[0][key].copy()
        for h, own in zip(hosts, owned):
            out[own] = h[key][own]
        merged[key] = out
    return merged


def host_per_window(host: dict[str, Any], deltas: list[float]) -> dict[str, Any]:
    """Shape one layer's merged host arrays as the artifact's per-window dict."""
    pw: dict[str, Any] = {
        "load": host["load"],
        "p_mass_total": host["p_mass"].sum(axis=0),
        "boundary_mass": {
            f"{delta:g}": {"sum": host[f"bm{i}.sum"], "count": host["margin_mean.count"]}
            for i, delta in enumerate(deltas)
        },
        "near_tie": {name: {"sum": host[f"near_tie.{name}"], "count": host["margin_mean.count"]}
                     for name in NEAR_TIE_DTYPES},
        "transition_jump": [row[np.isfinite(row)] for row in host["jump"]],
    }
    for name in _SUM_COUNT:
        pw[name] = {"sum": host[name + ".sum"], "count": host[name + ".count"]}
    for name in COUNTERS:
        pw[name] = host[name]
    for target, key in (("", "drift"), ("base.", "drift_base")):
        if target + DRIFT_RECEIPTS[0] + ".sum" in host:
            pw[key] = {name: {"sum": host[target + name + ".sum"], "count": host[target + name + ".count"]}
                       for name in DRIFT_RECEIPTS}
            pw[key].update({name: host[target + name] for name in _DRIFTCOUNTERS})
    return pw


def spool_collected(captures: list[LayerCapture]) -> None:
    """At the end of a micro-batch, move the anchor rows every layer on an accelerator collected to its spool
    (docs/record.md#baselines-on-disk), all layers' read back to the host in one transfer (``engine/transfer.py``); a
    layer on the CPU has spooled them as it collected them."""
    held = [cap for cap in captures if cap.collected]
    for cap, rows in zip(held, read_back([cap.collected for cap in held])):
        cap.spool_rows(rows)
