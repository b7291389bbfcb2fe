"""The transformers family adapter: one :class:`HFLayer` reads any row of the family table.

A row (:class:`Family`) says where the pre-norm is (a path from the decoder layer), its kind (RMSNorm or
mean-centred LayerNorm) and gain convention (``w`` or zero-centred ``1 + w``), the router attribute and its semantics
(``adapters/routers.py``), the shared-expert wiring (:class:`Shared`), any scaling the block
applies to the routed sum, and which layer class reads the experts. Most families call fused
experts as ``experts(x, top_k_index, top_k_weights)``, evaluated unweighted with unit weights;
the few layouts that differ are the small subclasses below (Llama 4's input-scaled experts,
JetMoE's parallel experts, Nemotron-H's latent projections, Inkling's router-gated shared experts, DBRX's
reshaped experts output).
Nothing here imports transformers: blocks are matched by class name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from atlas_tracking.adapters.base import (
    NoRoutedLayersError,
    RouteCount,
    RoutedLayer,
    Routing,
    register_family,
)
from atlas_tracking.adapters.grouped_experts import (
    grouped_fields,
    grouped_implementation,
    interleaves,
    pair_fields,
)
from atlas_tracking.adapters.routers import BiasedScores, TopLogits, resolve

Scale = Callable[[nn.Module], float]
"""block -> a factor the block applies to a sum after the experts call (e.g. ``routed_scaling_factor``)."""


@dataclass(frozen=True)
class Shared:
    """Always-on shared experts: ``scale(block) * [sigmoid(gate(g)) *] module(g)``, the transport baseline."""

    module: str = "shared_experts"
    gate: str | None = None
    """Path of a linear whose sigmoid gates the shared output (Qwen2-MoE's ``shared_expert_gate``)."""
    scale: Scale | None = None

    def __call__(self, layer: HFLayer, g: torch.Tensor) -> torch.Tensor | None:
        module = resolve(layer.block, self.module)
        if module is None:
            return None
        out = module(g)
        if self.gate is not None:
            out = torch.sigmoid(resolve(layer.block, self.gate)(g)) * out
        return out * self.scale(layer.block) if self.scale is not None else out


@dataclass(frozen=True)
class Family:
    """One row of the transformers family table (``adapters/families.py``)."""

    name: str
    """Family name (the transformers model type)."""
    blocks: tuple[str, ...]
    """MoE block class names this row reads."""
    router: TopLogits | BiasedScores
    norm: str = "post_attention_layernorm"
    """The pre-norm, as a path from the decoder layer holding the block."""
    gain: str = "w"
    """'w' (``g = w * z``) or '1+w' (zero-centred gain, ``g = (1 + w) * z``)."""
    norm_type: str | Callable[[nn.Module], str] = "rms"
    """'rms' or 'layernorm' (a mean-centred LayerNorm, ``g = Gamma z + beta``; docs/receipts.md#layernorm-state),
    or norm module -> one of them (a family whose config picks its norm class)."""
    shared: Shared | None = None
    router_attr: str = "gate"
    scale: Scale | None = None
    """A factor the block applies to the routed sum after the experts call."""
    num_experts: str = "router.num_experts"
    zero_experts: str | None = None
    """Path of the number of real experts, where the ids after them (up to ``num_experts``) are zero-computation
    experts: identity slots that carry no field (docs/receipts.md#zero-computation-experts)."""
    top_k: str | int = "router.top_k"
    """A path to the experts per token, or their number where the router fixes it."""
    router_args: tuple[str, ...] = ()
    """Paths of extra arguments the block passes its router (a bias held by the block)."""
    router_3d: bool = False
    """The router reads ``[batch, seq, d]`` (not flattened tokens)."""
    experts: str = "experts"
    layer: type[HFLayer] | None = None
    """The layer class; None: :class:`HFLayer`."""
    skip: Callable[[nn.Module], str | None] | None = None
    """block -> the reason this routed block is not read (it is then left out), or None."""
    model_types: tuple[str, ...] = field(default=())
    """Further transformers model types served by this row (composite configs of the same text model)."""


class HFLayer(RoutedLayer):
    """A transformers MoE block read through its family row."""

    def __init__(self, name: str, index: int, block: nn.Module, norm: nn.Module, router: nn.Module,
                 experts: nn.Module, row: Family):
        super().__init__(name, index, block, norm, router, experts)
        self.row = row
        self.family = row.name
        self.router_kind = row.router.kind
        self.norm_type = row.norm_type if isinstance(row.norm_type, str) else row.norm_type(norm)

    @property
    def num_experts(self) -> int:
        return int(resolve(self, self.row.num_experts))

    @property
    def top_k(self) -> int:
        return self.row.top_k if isinstance(self.row.top_k, int) else int(resolve(self, self.row.top_k))

    @property
    def zero_experts(self) -> frozenset[int]:
        if self.row.zero_experts is None:
            return frozenset()
        return frozenset(range(int(resolve(self, self.row.zero_experts)), self.num_experts))

    def gamma(self) -> torch.Tensor:
        weight = self.norm.weight.float()
        return weight + 1.0 if self.row.gain == "1+w" else weight

    def routing(self, router_output: Any, g: torch.Tensor) -> Routing:
        logits, weights, index = self.row.router.read(self, router_output)
        scores, probs = self.row.router.selection(self, logits)
        active = index.reshape(len(scores), -1).long()
        weights = weights.reshape(active.shape).float()
        if self.row.scale is not None:
            weights = weights * self.row.scale(self.block)
        rho = probs.gather(1, active)
        return Routing(scores=scores, probs=probs, active=active, weights=weights,
                       rho=rho / rho.sum(dim=1, keepdim=True).clamp_min(torch.finfo(rho.dtype).tiny))

    def router_logits(self, router_output: Any, routing: Routing) -> torch.Tensor:
        return self.row.router.read(self, router_output)[0]

    def _router_forward(self, g: torch.Tensor) -> Any:
        args = [resolve(self, path) for path in self.row.router_args]
        return self.router.forward(g.unsqueeze(0) if self.row.router_3d else g, *args)

    def route(self, g: torch.Tensor) -> Routing:
        g = g.reshape(-1, g.shape[-1])
        return self.routing(self._router_forward(g), g)

    def route_active(self, g: torch.Tensor) -> torch.Tensor:
        g = g.reshape(-1, g.shape[-1])
        return self.row.router.read(self, self._router_forward(g))[2].reshape(len(g), -1).long()

    def count_routes(self, router_inputs: tuple, router_output: Any) -> RouteCount:
        """The top-k index the router returned (``read``), counted per expert."""
        return RouteCount(index=self.row.router.read(self, router_output)[2])

    def shared_output(self, g: torch.Tensor) -> torch.Tensor | None:
        return self.row.shared(self, g) if self.row.shared is not None else None

    def grouped_outputs(self, hidden: torch.Tensor, index: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]]
                        ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """transformers' ``grouped_mm`` experts read as their own code computes them (``adapters/grouped_experts.py``),
        for a layer whose experts are called as the table reads them (no reading of its own for the pairs)."""
        moe = self._grouped_implementation()
        return None if moe is None else grouped_fields(self.experts, hidden, index, pairs, moe)

    def grouped_pair_outputs(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor] | None:
        moe = self._grouped_implementation()
        return None if moe is None else pair_fields(self.experts, pairs, moe)

    def pools_pairs(self) -> bool:
        """Where the experts run transformers' ``grouped_mm`` as grouped products (each expert's weights under
        ``INTERLEAVE_BYTES`` on the CPU): wider experts already evaluate the competitors in the active set's pass."""
        return self._grouped_implementation() is not None and not interleaves(self.experts)

    def _grouped_implementation(self) -> Any:
        """transformers' experts module where this layer's experts run its ``grouped_mm`` and are called as the
        table reads them (no reading of its own for the pairs), else None."""
        if type(self).pair_outputs is not RoutedLayer.pair_outputs or not self.fusable:
            return None
        return grouped_implementation(self.experts)


class InputScaledLayer(HFLayer):
    """Llama 4: each expert reads its input scaled by its routing weight (``expert_e(w_e g)``), through a
    dense ``[E, tokens, d]`` batched experts module.

    The field is what the expert contributes per unit weight, ``u_e(g) = expert_e(w_e(g) g) / w_e(g)``
    with ``w_e(g) = sigmoid(logit_e(g))`` (the weight expert e has, or would have, at g), so that
    ``sum_{e in R} w_e u_e(g) + shared(g)`` is the block's output exactly.
    """

    fusable = False

    def input_weights(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``w_e`` of each (row, expert) pair, in the model's dtype as the model applies it."""
        logits = F.linear(rows, self.router.weight)
        return torch.sigmoid(logits.float()).to(rows.dtype).gather(1, experts.view(-1, 1))

    def pair_outputs(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        w = self.input_weights(rows, experts)
        counts = torch.bincount(experts, minlength=self.num_experts)
        slots = int(counts.max()) if len(experts) else 0
        order = torch.argsort(experts, stable=True)
        first = torch.cumsum(counts, 0) - counts
        pos = torch.empty_like(order)
        pos[order] = torch.arange(len(order), device=order.device) - first[experts[order]]
        padded = rows.new_zeros(self.num_experts, slots, rows.shape[-1])
        padded[experts, pos] = rows * w
        y = self.experts(padded.view(-1, rows.shape[-1])).view(self.num_experts, slots, -1)[experts, pos]
        return y.float() / w.float().clamp_min(torch.finfo(torch.float32).tiny)


class JetMoeLayer(HFLayer):
    """JetMoE: experts as two ``JetMoeParallelExperts`` (GLU), run on rows sorted by expert; a learned
    output bias added to every token is the transport baseline."""

    fusable = False

    def pair_outputs(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(experts, stable=True)
        sizes = torch.bincount(experts, minlength=self.num_experts).tolist()
        hidden = self.block.input_linear(rows.index_select(0, order), sizes)
        a, b = hidden.chunk(2, dim=-1)
        out = self.block.output_linear(self.block.activation(a) * b, sizes)
        return torch.empty_like(out).index_copy_(0, order, out)

    def shared_output(self, g: torch.Tensor) -> torch.Tensor:
        return self.block.bias.expand_as(g)


class LatentLayer(HFLayer):
    """Nemotron-H: experts (non-gated) may run in a latent space, ``fc2(sum w expert(fc1(g)))``; the
    field is ``W2 expert_e(fc1(g))`` and fc2's bias joins the shared output."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.fusable = isinstance(self.block.fc1_latent_proj, nn.Identity)

    def pair_outputs(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        if self.fusable:
            return super().pair_outputs(rows, experts)
        fc2 = self.block.fc2_latent_proj
        return F.linear(super().pair_outputs(self.block.fc1_latent_proj(rows), experts), fc2.weight)

    def shared_output(self, g: torch.Tensor) -> torch.Tensor | None:
        out = super().shared_output(g)
        bias = getattr(self.block.fc2_latent_proj, "bias", None)
        return out if bias is None else out + bias


class TwoSlotLayer(HFLayer):
    """LongCat-Flash: its experts' forward squeezes a one-slot routing mask away, so each (token, expert) pair is
    called in two slots, the second with weight 0. Its ``zero_expert_num`` zero-computation experts, the ids after
    the ``num_routed_experts`` real ones, return their input (the gate input ``g``) unchanged: routable slots that
    carry no field (its row's ``zero_experts``)."""

    def pair_outputs(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        call = self.experts_forward if self.experts_forward is not None else self.experts
        weights = torch.tensor([1.0, 0.0], dtype=rows.dtype, device=rows.device).expand(len(experts), 2)
        return call(rows, experts.view(-1, 1).expand(-1, 2), weights)


class FlatOutputLayer(HFLayer):
    """DBRX: its experts' forward reshapes its output to ``[rows, 1, d]`` and its block hands it ``[batch, seq, d]``
    inputs, so the experts are called outside the forward (unfused) and each pair's output is read as ``[d]``."""

    fusable = False

    def pair_outputs(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return super().pair_outputs(rows, experts).reshape(len(rows), -1)


class RouterGatedSharedLayer(HFLayer):
    """Inkling: the router normalises routed and shared experts together and returns the shared experts'
    gates (``shared_gammas``), which the shared experts multiply in."""

    def shared_output(self, g: torch.Tensor) -> torch.Tensor:
        return self.block.shared_experts(g, gammas=self.router.forward(g)[3])


def refuse(family: str, reason: str) -> Callable[[str, int, nn.Module, nn.Module], RoutedLayer | None]:
    """A registry factory for blocks that cannot be read exactly: the error names the family and the reason."""

    def make(name: str, index: int, block: nn.Module, parent: nn.Module) -> RoutedLayer | None:
        raise NoRoutedLayersError(f"{family} MoE block {name} ({type(block).__name__}) cannot be read exactly: {reason}")

    return make


def factory(row: Family) -> Callable[[str, int, nn.Module, nn.Module], RoutedLayer | None]:
    """The registry factory of one table row: the block's router, experts, and pre-norm in its decoder layer."""

    def make(name: str, index: int, block: nn.Module, parent: nn.Module) -> RoutedLayer | None:
        if row.skip is not None and row.skip(block):
            return None
        parts = {f"router {row.router_attr}": resolve(block, row.router_attr),
                 f"experts {row.experts}": resolve(block, row.experts)}
        norm = resolve(parent, row.norm)
        missing = [what for what, module in parts.items() if module is None]
        if missing or norm is None:
            where = missing + ([f"pre-norm {row.norm} in its decoder layer {type(parent).__name__}"] if norm is None else [])
            raise NoRoutedLayersError(f"{row.name} MoE block {name} ({type(block).__name__}) lacks its "
                                      f"{', '.join(where)}; pass layers= explicitly or register an adapter")
        router, experts = parts.values()
        return (row.layer or HFLayer)(name, index, block, norm, router, experts, row)

    return make


def register_rows(rows: tuple[Family, ...], refused: dict[str, tuple[tuple[str, ...], str]]) -> None:
    """Register every row of the family table and every refused family's blocks."""
    for row in rows:
        for block in row.blocks:
            register_family(block, row.name, factory(row))
    for family, (blocks, reason) in refused.items():
        for block in blocks:
            register_family(block, family, refuse(family, reason))
