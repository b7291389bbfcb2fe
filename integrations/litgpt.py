"""LitGPT: an adapter for ``litgpt.model.LLaMAMoE``, the MoE block of every LitGPT MoE config.

LitGPT builds Mixtral-, Qwen3-MoE- and DeepSeek-style models from one block: a router ``gate`` that is
either a plain linear (top-k of the logits, softmax over the k) or a ``GroupedTopkRouter`` (sigmoid plus
a correction bias ranked inside the best groups, masked experts filled with 0, optionally normalised),
the weights times ``config.routed_scaling_factor``, experts as an ``nn.ModuleList`` of ``LLaMAMLP`` and
optional ``shared_experts``. The pre-norm is the block's ``norm_2`` (``norm_1`` under a shared attention
norm); LitGPT's ``RMSNorm(add_unit_offset=True)`` has a zero-centred ``(1 + w)`` gain. LayerNorm configs
(``torch.nn.LayerNorm``) are read on the LayerNorm state (docs/receipts.md#layernorm-state). Blocks are found by class inside a ``GPT`` and through the
wrappers of its Fabric / Lightning training scripts (``_FabricModule``, a ``LightningModule``); LitGPT
itself is not imported here.

    >>> from litgpt import GPT, Config
    >>> from atlas_tracking import find_routed_layers
    >>> model = GPT(Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, padded_vocab_size=64, block_size=32,
    ...                    mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, intermediate_size=48,
    ...                    moe_intermediate_size=24, norm_class_name="RMSNorm"))
    >>> [(lay.name, lay.family, lay.router_kind) for lay in find_routed_layers(model)]
    [('transformer.h.0.mlp', 'litgpt', 'topk_softmax'), ('transformer.h.1.mlp', 'litgpt', 'topk_softmax')]
"""

from __future__ import annotations

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
from atlas_tracking.adapters.routers import BiasedScores, GroupLimit, distribution

GROUPED = BiasedScores(groups=GroupLimit(n_group="block.config.n_expert_groups", topk_group="block.config.n_topk_groups",
                                         top="block.config.n_topk_scores_per_group", fill=0.0),
                       kind="sigmoid+bias, group-limited (mask filled with 0)")
"""``GroupedTopkRouter``'s choice: sigmoid + correction bias inside the best groups (paths from the layer)."""


class LitGPTMoELayer(RoutedLayer):
    """A LitGPT ``LLaMAMoE`` inside its ``Block``."""

    family = "litgpt"
    fusable = False

    @property
    def grouped(self) -> bool:
        return bool(self.block.config.n_expert_groups)

    @property
    def router_kind(self) -> str:  # type: ignore[override]
        return GROUPED.kind if self.grouped else "topk_softmax"

    @property
    def num_experts(self) -> int:
        return int(self.block.config.n_expert)

    @property
    def top_k(self) -> int:
        return int(self.block.config.n_expert_per_token)

    def gamma(self) -> torch.Tensor:
        weight = self.norm.weight.float()
        return weight + 1.0 if getattr(self.norm, "add_unit_offset", False) else weight

    def routing(self, router_output: Any, g: torch.Tensor) -> Routing:
        scale = float(self.block.config.routed_scaling_factor)
        if self.grouped:  # (weights, indices); the logits are the router's own fp32 linear
            weights, index = router_output
            logits = F.linear(g.float(), self.router.weight.float())
            scores, probs = GROUPED.selection(self, logits)
        else:  # the logits; the block runs topk and a softmax over the k itself
            logits = router_output
            top, index = torch.topk(logits, self.top_k)
            weights = top.softmax(dim=1, dtype=torch.float).to(logits.dtype)
            scores, probs = logits.float(), distribution("softmax", logits)
        active = index.long()
        rho = probs.gather(1, active)
        return Routing(scores=scores, probs=probs, active=active, weights=weights.float() * scale,
                       rho=rho / rho.sum(dim=1, keepdim=True))

    def router_logits(self, router_output: Any, routing: Routing) -> torch.Tensor:
        return torch.where(torch.isinf(routing.scores), 0.0, routing.scores)

    def count_routes(self, router_inputs: tuple, router_output: Any) -> RouteCount:
        """The router's indices (grouped routing) or the top-k of its logits, which the block takes itself."""
        index = router_output[1] if self.grouped else torch.topk(router_output, self.top_k).indices
        return RouteCount(index=index)

    def pair_outputs(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each row through its expert's own ``LLaMAMLP``, one call per expert present."""
        out = None
        for e in torch.unique(experts).tolist():
            sel = torch.nonzero(experts == e).flatten()
            y = self.experts[e](rows.index_select(0, sel))
            out = rows.new_zeros((len(rows), y.shape[-1]), dtype=y.dtype) if out is None else out
            out.index_copy_(0, sel, y)
        return out if out is not None else torch.zeros_like(rows)

    def shared_output(self, g: torch.Tensor) -> torch.Tensor | None:
        shared = getattr(self.block, "shared_experts", None)
        return None if shared is None else shared(g)


def _make(name: str, index: int, block: nn.Module, parent: nn.Module) -> RoutedLayer | None:
    config = block.config
    norm = parent.norm_1 if getattr(config, "shared_attention_norm", False) else getattr(parent, "norm_2", None)
    if norm is None or isinstance(norm, nn.Identity):
        raise NoRoutedLayersError(f"LitGPT MoE block {name}: its Block has no pre-norm in front of the MoE "
                                  "(norm_2 is disabled), so there is no gate input g = Gamma z")
    return LitGPTMoELayer(name, index, block, norm, block.gate, block.experts)


register_family("litgpt.model.LLaMAMoE", "litgpt", _make)
