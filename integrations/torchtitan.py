"""torchtitan: an adapter for ``torchtitan.models.moe.MoE`` (torchtitan 0.2.x), the MoE of its DeepSeek-V3, Qwen3
and Llama 4 models.

The block (``.moe`` of a ``TransformerBlock``, behind ``.ffn_norm``) holds a ``TokenChoiceTopKRouter``
(``.router``: a ``gate`` linear, sigmoid or softmax scores in fp32, the load-balancing ``expert_bias`` the
block passes in for the choice only, optional node-limited groups, ``route_norm`` and ``route_scale`` on the
weights), ``GroupedExperts`` (``.experts``: called on rows sorted by expert with per-expert counts, by a
for-loop or grouped GEMM) and optional ``shared_experts``. Active sets and weights are read from the
router's own output; selection scores are recomputed from the router input as it ranks them. Fields come
from the block's own experts module on expert-sorted rows. With ``score_before_experts`` (the Llama 4
flavour) each expert reads its input scaled by its weight; the field is then what the expert adds per unit
weight, ``expert_e(w_e g) / w_e``, which needs ``w_e`` defined for every expert, so that combination is
read only without ``route_norm``. A gate restores the block's ``tokens_per_expert`` (which its forward
accumulates even in eval mode), so it leaves no trace in expert-bias balancing. torchtitan is not imported.

On a CPU, torchtitan 0.2's router counts tokens per expert with ``torch.histc`` on int64 indices, which
only CUDA implements: ``atlas_tracking.testing.torchtitan_cpu`` holds the named stand-in the example and tests use.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from atlas_tracking.integrations.autoep import _keep_load_statistics
from torch import nn

from atlas_tracking.adapters.base import (
    NoRoutedLayersError,
    RouteCount,
    RoutedLayer,
    Routing,
    register_family,
)
from atlas_tracking.adapters.routers import BiasedScores, GroupLimit

_GROUPS = GroupLimit(n_group="router.num_expert_groups", topk_group="router.num_limited_groups",
                     when=lambda lay: lay.router.num_expert_groups is not None)
SCORES = {func: BiasedScores(score=func, bias="block.expert_bias", groups=_GROUPS, kind=f"{func}+bias")
          for func in ("sigmoid", "softmax")}
"""The router's choice for each score function (expert bias from the block, node-limited groups)."""


class TorchtitanMoELayer(RoutedLayer):
    """A torchtitan ``MoE`` inside its ``TransformerBlock``."""

    family = "torchtitan"
    fusable = False

    @property
    def router_kind(self) -> str:  # type: ignore[override]
        return self.router.score_func + (", input-scaled" if self.block.score_before_experts else "")

    @property
    def num_experts(self) -> int:
        return int(self.router.num_experts)

    @property
    def top_k(self) -> int:
        return int(self.router.top_k)

    @property
    def norm_eps(self) -> float:
        eps = getattr(self.norm, "eps", None)
        return float(eps) if eps is not None else torch.finfo(self.norm.weight.dtype).eps

    def gate_context(self) -> contextlib.AbstractContextManager:
        return _keep_load_statistics(self.block)

    def scores(self, g: torch.Tensor) -> torch.Tensor:
        """The router's fp32 scores of every expert (sigmoid or softmax of its gate linear)."""
        logits = self.router.gate(g).float()
        return torch.sigmoid(logits) if self.router.score_func == "sigmoid" else torch.softmax(logits, dim=1)

    def routing(self, router_output: Any, g: torch.Tensor) -> Routing:
        top_scores, index, _ = router_output
        logits = self.router.gate(g.reshape(-1, g.shape[-1]))
        scores, probs = SCORES[self.router.score_func].selection(self, logits)
        active = index.long()
        rho = probs.gather(1, active)
        return Routing(scores=scores, probs=probs, active=active, weights=top_scores.float(),
                       rho=rho / rho.sum(dim=1, keepdim=True))

    def router_logits(self, router_output: Any, routing: Routing) -> torch.Tensor:
        return torch.where(torch.isinf(routing.scores), 0.0, routing.scores)

    def count_routes(self, router_inputs: tuple, router_output: Any) -> RouteCount:
        """The selected experts the router returned, counted per expert (torchtitan never drops a route)."""
        return RouteCount(index=router_output[1])

    def route(self, g: torch.Tensor) -> Routing:
        g = g.reshape(-1, g.shape[-1])
        return self.routing(self.router.forward(g, self.block.expert_bias), g)

    def pair_outputs(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert through the block's own ``GroupedExperts``; with ``score_before_experts``
        each row enters scaled by its expert's weight, as the block scales it, and leaves divided by it."""
        scale = None
        if self.block.score_before_experts:
            scale = self.scores(rows).gather(1, experts.view(-1, 1)) * self.router.route_scale
            rows = (rows.float() * scale).to(rows.dtype)
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=self.num_experts)
        out = self.experts(rows.index_select(0, order), counts)
        out = torch.empty_like(out).index_copy_(0, order, out)
        return out if scale is None else out.float() / scale.clamp_min(torch.finfo(torch.float32).tiny)

    def shared_output(self, g: torch.Tensor) -> torch.Tensor | None:
        shared = self.block.shared_experts
        return None if shared is None else shared(g)


def _make(name: str, index: int, block: nn.Module, parent: nn.Module) -> RoutedLayer | None:
    router = getattr(block, "router", None)
    if router is None or not hasattr(router, "score_func"):
        return None
    if getattr(router, "_debug_force_load_balance", False):
        raise NoRoutedLayersError(f"torchtitan MoE {name} routes round-robin (_debug_force_load_balance): "
                                  "its choice is not a top-k of any score")
    if block.score_before_experts and router.route_norm:
        raise NoRoutedLayersError(
            f"torchtitan MoE {name} scales expert inputs by weights normalised over each token's active set "
            "(score_before_experts with route_norm): an expert outside the set has no weight, so its field is undefined")
    norm = getattr(parent, "ffn_norm", None)
    if norm is None:
        raise NoRoutedLayersError(f"torchtitan MoE {name}: its block {type(parent).__name__} has no ffn_norm in front of it")
    return TorchtitanMoELayer(name, index, block, norm, router, block.experts)


register_family("torchtitan.models.moe.moe.MoE", "torchtitan", _make)
