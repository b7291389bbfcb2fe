"""Megatron-Core: an adapter for ``MoELayer`` / ``TopKRouter`` and the selection semantics of its router.

``megatron_selection`` reproduces ``moe_utils.topk_routing_with_score_function`` (softmax before
or after top-k, sigmoid with expert bias, group-limited top-k, scaling factor) and returns what
the atlas needs: selection scores with ineligible experts at ``-inf``, the full routing
distribution, the active set and the model's combine weights. ``MegatronMoELayer`` reads a layer
``decoder.layers.i`` (``pre_mlp_layernorm`` -> ``mlp`` with ``.router``, ``.experts`` as
``SequentialMLP`` or the legacy grouped-GEMM ``GroupedMLP``, optional ``.shared_experts``), handles
sequence-first hidden states, zero-centred gamma norms, and expert parallelism (the block's
``ep_group`` and ``local_expert_indices``: a gate asks the owning rank for fields of experts held
elsewhere, see ``atlas_tracking.engine.fields``). During a gate the router's input jitter
(``moe_input_jitter_eps``) is switched off. Megatron-Core is not imported here: layers are matched by
class name, and ``TopKRouter.gating`` (which moves weights to CUDA) is never called.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from atlas_tracking.adapters.base import RouteCount, RoutedLayer, Routing, expert_counts, register_family


@dataclass
class RouterSpec:
    """The routing configuration of a Megatron ``TopKRouter`` (``TransformerConfig`` fields)."""

    topk: int
    score_function: str = "softmax"
    pre_softmax: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float | None = None
    expert_bias: torch.Tensor | None = None

    @classmethod
    def from_router(cls, router: nn.Module) -> RouterSpec:
        c = router.config
        return cls(
            topk=int(c.moe_router_topk), score_function=c.moe_router_score_function,
            pre_softmax=bool(c.moe_router_pre_softmax), num_groups=c.moe_router_num_groups,
            group_topk=c.moe_router_group_topk, scaling_factor=c.moe_router_topk_scaling_factor,
            expert_bias=getattr(router, "expert_bias", None),
        )


def _group_mask(scores: torch.Tensor, spec: RouterSpec) -> torch.Tensor | None:
    """Experts inside the selected groups (Megatron ``group_limited_topk``), or None without groups."""
    if not spec.group_topk:
        return None
    n, e = scores.shape
    group_scores = scores.view(n, spec.num_groups, -1).topk(spec.topk // spec.group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=spec.group_topk, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    return mask.unsqueeze(-1).expand(n, spec.num_groups, e // spec.num_groups).reshape(n, e).bool()


def megatron_selection(logits: torch.Tensor, spec: RouterSpec) -> Routing:
    """Selection scores, distribution, active set and combine weights exactly as Megatron routes ``logits``."""
    logits = logits.float()
    if spec.score_function == "softmax":
        probs_full = torch.softmax(logits, dim=-1)
        ranked = probs_full if spec.pre_softmax else logits
        selection = logits
    elif spec.score_function == "sigmoid":
        sig = torch.sigmoid(logits)
        probs_full = sig / sig.sum(dim=-1, keepdim=True)
        ranked = sig + spec.expert_bias.float() if spec.expert_bias is not None else sig
        selection = ranked
    else:
        raise ValueError(f"unsupported Megatron score function {spec.score_function!r}")
    mask = _group_mask(ranked, spec)
    if mask is not None:
        ranked = ranked.masked_fill(~mask, float("-inf"))
        selection = selection.masked_fill(~mask, float("-inf"))
    active = torch.topk(ranked, k=spec.topk, dim=1).indices
    if spec.score_function == "softmax":
        weights = probs_full.gather(1, active) if spec.pre_softmax else torch.softmax(logits.gather(1, active), dim=-1)
    else:
        top = torch.sigmoid(logits).gather(1, active)
        weights = top / (top.sum(dim=-1, keepdim=True) + 1e-20) if spec.topk > 1 else top
    if spec.scaling_factor:
        weights = weights * spec.scaling_factor
    rho = probs_full.gather(1, active)
    return Routing(scores=selection, probs=probs_full, active=active, weights=weights,
                   rho=rho / rho.sum(dim=1, keepdim=True))


def _unjittered(x: torch.Tensor) -> torch.Tensor:
    return x


@contextlib.contextmanager
def _without_input_jitter(router: nn.Module) -> Iterator[None]:
    """The router's ``apply_input_jitter`` shadowed by the identity on this router only (its config is shared)."""
    router.apply_input_jitter = _unjittered
    try:
        yield
    finally:
        del router.apply_input_jitter


class MegatronMoELayer(RoutedLayer):
    """A Megatron-Core ``MoELayer`` inside a ``TransformerLayer``."""

    family = "megatron"
    fusable = False
    sequence_first = True

    @property
    def router_kind(self) -> str:  # type: ignore[override]
        return "sigmoid" if self.router.config.moe_router_score_function == "sigmoid" else "softmax"

    @property
    def num_experts(self) -> int:
        return int(self.router.config.num_moe_experts)

    @property
    def top_k(self) -> int:
        return int(self.router.config.moe_router_topk)

    @property
    def norm_eps(self) -> float:
        return float(getattr(self.norm, "eps", getattr(self.norm, "epsilon", 1e-5)))

    def gamma(self) -> torch.Tensor:
        weight = self.norm.weight.float()
        zero_centred = getattr(self.norm, "zero_centered_gamma", False) or getattr(
            getattr(self.norm, "config", None), "layernorm_zero_centered_gamma", False)
        return weight + 1.0 if zero_centred else weight

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """The router's gating linear in its routing dtype, on whatever device g is on."""
        r = self.router
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(getattr(r.config, "moe_router_dtype", None), g.dtype)
        bias = r.bias.to(dtype) if getattr(r, "bias", None) is not None else None
        return F.linear(g.to(dtype), r.weight.to(device=g.device, dtype=dtype), bias)

    def routing(self, router_output: Any, g: torch.Tensor) -> Routing:
        g = g.reshape(-1, g.shape[-1])
        routing = megatron_selection(self.logits(g), RouterSpec.from_router(self.router))
        if isinstance(router_output, tuple) and len(router_output) == 2:
            probs, routing_map = router_output
            model = routing_map.reshape(-1, self.num_experts)
            ours = torch.zeros_like(model).scatter_(1, routing.active, True)
            if not torch.equal(model, ours):
                raise RuntimeError(f"{self.name}: the recomputed top-k differs from the router's routing_map")
            routing.weights = probs.reshape(-1, self.num_experts).float().gather(1, routing.active)
        return routing

    def router_logits(self, router_output: Any, routing: Routing) -> torch.Tensor:
        return torch.where(torch.isinf(routing.scores) & (routing.scores < 0), 0.0, routing.scores)

    def count_routes(self, router_inputs: tuple, router_output: Any) -> RouteCount:
        """The router's ``routing_map`` summed per expert. With ``moe_expert_capacity_factor`` that map has the dropped
        routes taken out, so the choice before the limit is the top-k of the router's logits, recomputed from its
        input as :meth:`route` does (with ``moe_input_jitter_eps`` the router ranked a jittered input, which the
        recomputation does not see)."""
        kept = router_output[1].reshape(-1, self.num_experts).sum(dim=0, dtype=torch.int64)
        if self.router.config.moe_expert_capacity_factor is None:
            return RouteCount(kept)
        chosen = expert_counts(self.route(router_inputs[0]).active, self.num_experts)
        return RouteCount(chosen, chosen - kept)

    def gate_context(self) -> contextlib.AbstractContextManager:
        """``moe_input_jitter_eps`` multiplies the router's input by a uniform draw in eval mode too: switched off
        during a gate, so the router routes the input the gate reads (docs/distributed.md#random-routing)."""
        return _without_input_jitter(self.router)

    def route(self, g: torch.Tensor) -> Routing:
        g = g.reshape(-1, g.shape[-1])
        return megatron_selection(self.logits(g), RouterSpec.from_router(self.router))

    def expert_placement(self) -> tuple[Any, torch.Tensor] | None:
        """With expert parallelism, expert ``e`` is held by rank ``e // num_local_experts`` of the block's
        ``ep_group`` (Megatron's ``local_expert_indices`` offset)."""
        n_local = int(getattr(self.block, "num_local_experts", self.num_experts))
        if n_local == self.num_experts:
            return None
        return self.block.ep_group, torch.arange(self.num_experts) // n_local

    def _expert_fn(self) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """``(local expert index, rows) -> unweighted outputs`` for the block's experts module.

        ``SequentialMLP``: each local expert's own forward at unit probability, bias included.
        ``GroupedMLP`` (legacy grouped GEMM): ``weight1``/``weight2`` viewed per local expert as
        its forward views them (``[num_local_experts, hidden, -1]`` and ``[num_local_experts, -1,
        hidden]``), its activation (GLU: the first half of fc1's output, activated, times the second
        half); it has no biases. ``TEGroupedMLP`` (Transformer Engine) is not read yet.
        """
        experts = self.experts
        local = getattr(experts, "local_experts", None)
        if local is not None:
            def sequential(i: int, x: torch.Tensor) -> torch.Tensor:
                y, bias = local[i](x, torch.ones(x.shape[0], dtype=x.dtype, device=x.device))
                return y + bias if bias is not None else y

            return sequential
        if type(experts).__name__ == "GroupedMLP":
            c = experts.config
            w1 = experts.weight1.view(experts.num_local_experts, c.hidden_size, -1)
            w2 = experts.weight2.view(experts.num_local_experts, -1, c.hidden_size)

            def grouped(i: int, x: torch.Tensor) -> torch.Tensor:
                h = x @ w1[i]
                if c.gated_linear_unit:
                    gate, up = torch.chunk(h, 2, dim=-1)
                    return (c.activation_func(gate) * up) @ w2[i]
                return c.activation_func(h) @ w2[i]

            return grouped
        raise NotImplementedError(
            f"{self.name}: field receipts need SequentialMLP or GroupedMLP experts; "
            f"{type(experts).__name__} is not read yet")

    def pair_outputs(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Unweighted output of global expert ``experts[i]`` at ``rows[i]``, one batched call per local expert.

        Rows are grouped by expert and mapped to local experts through the block's
        ``local_expert_indices`` (every expert asked for is held by this process).
        """
        run = self._expert_fn()
        ids = list(getattr(self.block, "local_expert_indices", range(self.experts.num_local_experts)))
        out = None
        for i, gid in enumerate(ids):
            sel = torch.nonzero(experts == gid).flatten()
            if sel.numel() == 0:
                continue
            y = run(i, rows.index_select(0, sel))
            if out is None:
                out = rows.new_zeros((rows.shape[0], y.shape[-1]), dtype=y.dtype)
            out.index_copy_(0, sel, y)
        return out if out is not None else torch.zeros_like(rows)

    def shared_output(self, g: torch.Tensor) -> torch.Tensor | None:
        shared = getattr(self.block, "shared_experts", None)
        if shared is None:
            return None
        out = shared(g.reshape(-1, 1, g.shape[-1]))
        out = out[0] if isinstance(out, tuple) else out
        return out.reshape(-1, out.shape[-1])

    def block_output(self, output: Any) -> torch.Tensor:
        out, bias = output if isinstance(output, tuple) else (output, None)
        return out + bias if bias is not None else out


def _make(name: str, index: int, block: nn.Module, parent: nn.Module) -> RoutedLayer | None:
    router, experts = getattr(block, "router", None), getattr(block, "experts", None)
    norm = getattr(parent, "pre_mlp_layernorm", None)
    if router is None or experts is None or norm is None or not hasattr(router, "config"):
        return None
    # ``layer_number`` is the model's own (1-based, counted over every pipeline stage); a stage's module path
    # numbers its own layers from 0
    number = getattr(parent, "layer_number", None)
    return MegatronMoELayer(name, int(number) - 1 if isinstance(number, int) else index, block, norm, router, experts)


register_family("MoELayer", "megatron", _make)
