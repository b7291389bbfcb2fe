"""DeepSpeed AutoEP: an adapter for ``AutoEPMoELayer`` (``deepspeed.module_inject.auto_ep_layer``).

AutoEP replaces a transformers MoE block with its own layer: a ``TokenChoiceTopKRouter`` (``.router``:
gate linear, softmax or sigmoid scores in fp32, optional expert bias and score-correction bias for
the choice only, optional group-limited choice, ``route_norm`` and ``route_scale`` on the weights),
``GroupedExperts`` (``.experts``, called on rows grouped by expert) and the source block's shared
experts. The adapter reads the active set and combine weights from the router's own output, and
recomputes its selection scores from the router input exactly as the router ranks them. Fields come
from the layer's own experts module through DeepSpeed's own row permutation. During a gate the
layer's ``tokens_per_expert`` load statistic is restored afterwards, so a gate leaves no trace in
load balancing. Layers that apply the scores before the experts (``score_apply="pre"``) are refused:
their output is not a weighted sum of unweighted expert fields. With ``ep_size > 1`` the layer's
``ep_group`` carries the gate's field exchange (AutoEP's uniform placement: rank ``r`` holds experts
``r * num_local_experts ..``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from atlas_tracking.integrations.deepspeed import NORM_NAMES, find_pre_norm
from torch import nn

from atlas_tracking.adapters.base import (
    NoRoutedLayersError,
    RouteCount,
    RoutedLayer,
    Routing,
    register_family,
)


def _group_mask(choice: torch.Tensor, groups: int, limited: int, score_func: str) -> torch.Tensor:
    """Experts inside the ``limited`` best of ``groups`` groups (``TokenChoiceTopKRouter``'s node-limited routing)."""
    n, e = choice.shape
    grouped = choice.view(n, groups, e // groups)
    group_scores = grouped.max(dim=-1).values if score_func == "max" else grouped.topk(2, dim=-1)[0].sum(dim=-1)
    idx = torch.topk(group_scores, k=limited, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, idx, True)
    return keep.unsqueeze(-1).expand(n, groups, e // groups).reshape(n, e)


class AutoEPLayer(RoutedLayer):
    """A DeepSpeed ``AutoEPMoELayer`` as a routed layer."""

    family = "deepspeed-autoep"
    fusable = False

    @property
    def router_kind(self) -> str:  # type: ignore[override]
        return "sigmoid" if self.router.score_func == "sigmoid" else "softmax"

    @property
    def num_experts(self) -> int:
        return int(self.block.num_experts)

    @property
    def top_k(self) -> int:
        return int(self.block.top_k)

    def gate_context(self) -> contextlib.AbstractContextManager:
        return _keep_load_statistics(self.block)

    def _choice_bias(self) -> torch.Tensor | None:
        biases = [b.float() for b in (self.block.expert_bias, self.router.e_score_correction_bias) if b is not None]
        return sum(biases[1:], biases[0]) if biases else None

    def routing(self, router_output: Any, g: torch.Tensor) -> Routing:
        top_scores, selected = router_output[0], router_output[1]
        gate = self.router.gate
        logits = F.linear(g.float(), gate.weight.float(), None if gate.bias is None else gate.bias.float())
        sigmoid = self.router.score_func == "sigmoid"
        scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
        bias = self._choice_bias()
        # ranked as the router ranks: its scores plus the choice biases; softmax without bias in logit units
        selection = logits if (bias is None and not sigmoid) else (scores if bias is None else scores + bias)
        if self.router.num_expert_groups is not None:
            keep = _group_mask(scores if bias is None else scores + bias, self.router.num_expert_groups,
                               self.router.num_limited_groups, self.router.group_score_func)
            selection = selection.masked_fill(~keep, float("-inf"))
        probs = scores / scores.sum(dim=-1, keepdim=True) if sigmoid else scores
        active = selected.long()
        rho = probs.gather(1, active)
        return Routing(scores=selection, probs=probs, active=active, weights=top_scores.float(),
                       rho=rho / rho.sum(dim=1, keepdim=True))

    def router_logits(self, router_output: Any, routing: Routing) -> torch.Tensor:
        return torch.where(torch.isinf(routing.scores) & (routing.scores < 0), 0.0, routing.scores)

    def route(self, g: torch.Tensor) -> Routing:
        g = g.reshape(-1, g.shape[-1])
        return self.routing(self.router.forward(g, self.block.expert_bias), g)

    def count_routes(self, router_inputs: tuple, router_output: Any) -> RouteCount:
        """The selected experts the router returned, counted per expert."""
        return RouteCount(index=router_output[1])

    def expert_placement(self) -> tuple[Any, torch.Tensor] | None:
        """With ``ep_size > 1`` expert ``e`` is held by rank ``e // num_local_experts`` of the layer's EP group
        (AutoEP's uniform placement)."""
        if int(self.block.ep_size) == 1:
            return None
        if self.block.ep_group is None:
            raise RuntimeError(f"{self.name}: ep_size={self.block.ep_size} but the layer has no expert-parallel "
                               "group yet (set by set_deepspeed_parallelism / deepspeed.initialize)")
        return self.block.ep_group, torch.arange(self.num_experts) // int(self.block.num_local_experts)

    def pair_outputs(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Rows grouped by (local) expert with DeepSpeed's own permutation, one call of ``GroupedExperts``."""
        from deepspeed.module_inject.auto_ep_layer import permute_by_local_expert, unpermute_by_local_expert

        n_local = int(self.block.num_local_experts)
        local_ids = experts - int(self.block.ep_rank) * n_local
        order = torch.argsort(local_ids, stable=True)
        counts = torch.bincount(local_ids, minlength=n_local)
        permuted, perm_idx, aligned, n = permute_by_local_expert(rows.index_select(0, order), counts)
        out = unpermute_by_local_expert(self.experts(permuted, aligned), perm_idx, n)
        return torch.empty_like(out).index_copy_(0, order, out)

    def shared_output(self, g: torch.Tensor) -> torch.Tensor | None:
        shared = self.block.shared_experts
        if shared is None:
            return None
        out = shared(g)
        if self.block.shared_experts_gate is not None:
            out = torch.sigmoid(self.block.shared_experts_gate(g)) * out
        return out


@contextlib.contextmanager
def _keep_load_statistics(block: nn.Module) -> Iterator[None]:
    """Restore the layer's ``tokens_per_expert`` (the load statistic its expert-bias update reads)."""
    saved = block.tokens_per_expert.clone()
    try:
        yield
    finally:
        block.tokens_per_expert.copy_(saved)


def _make(name: str, index: int, block: nn.Module, parent: nn.Module) -> RoutedLayer | None:
    if not getattr(block, "_is_autoep_layer", False):
        return None
    if block.score_apply != "post":
        raise NoRoutedLayersError(f"AutoEP layer {name} applies router scores before its experts (score_apply="
                                  f"{block.score_apply!r}); its output is not a weighted sum of expert fields")
    norm = find_pre_norm(parent, block)
    if norm is None:
        raise NoRoutedLayersError(f"AutoEP layer {name}: cannot tell which norm feeds it (looked for "
                                  f"{', '.join(NORM_NAMES)} or a single norm-like child of its parent)")
    return AutoEPLayer(name, index, block, norm, block.router, block.experts)


register_family("AutoEPMoELayer", "deepspeed-autoep", _make)
