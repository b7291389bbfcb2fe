"""Adapters for transformers 5.x MoE families: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS.

These blocks sit behind ``layers[i].post_attention_layernorm`` as ``layers[i].mlp`` with a router
(``.gate``, GPT-OSS ``.router``) returning ``(router_logits, top_k_weights, top_k_index)`` and
fused ``.experts`` called as ``experts(x, top_k_index, top_k_weights)``. Nothing here imports
transformers: families are matched by class name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from atlas_tracking.adapters.base import RoutedLayer, Routing, register_family


def _renormalise(values: torch.Tensor) -> torch.Tensor:
    return values / values.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(values.dtype).tiny)


class HFRouterLayer(RoutedLayer):
    """A transformers router with ``num_experts`` and ``top_k`` attributes."""

    @property
    def num_experts(self) -> int:
        return int(self.router.num_experts)

    @property
    def top_k(self) -> int:
        return int(self.router.top_k)


class HFSoftmaxLayer(HFRouterLayer):
    """Routers ranking logits with the softmax as distribution: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS."""

    router_kind = "softmax"

    def routing(self, router_output: Any, g: torch.Tensor) -> Routing:
        logits, top_weights, top_index = router_output
        scores = logits.float()
        probs = torch.softmax(scores, dim=-1)
        active = top_index.long()
        return Routing(
            scores=scores,
            probs=probs,
            active=active,
            weights=top_weights.float(),
            rho=_renormalise(probs.gather(1, active)),
        )


class Qwen2MoeLayer(HFSoftmaxLayer):
    """Qwen2-MoE: softmax router plus a sigmoid-gated shared expert (part of the transport baseline)."""

    def shared_output(self, g: torch.Tensor) -> torch.Tensor:
        return F.sigmoid(self.block.shared_expert_gate(g)) * self.block.shared_expert(g)


class DeepseekV3Layer(HFRouterLayer):
    """DeepSeek-V3: sigmoid scores + correction bias, group-limited top-k, scaled unbiased weights."""

    router_kind = "sigmoid"

    def eligible_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Selection scores ``sigmoid(logits) + bias`` with experts outside the chosen groups at -inf.

        Recomputed with the router's own operations, so the eligible groups are the model's.
        """
        r = self.router
        choice = logits.float().sigmoid() + r.e_score_correction_bias.float()
        n_group, per_group = r.num_group, self.num_experts // r.num_group
        group_scores = choice.view(-1, n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=r.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, per_group).reshape(-1, self.num_experts)
        return choice.masked_fill(~score_mask.bool(), float("-inf"))

    def routing(self, router_output: Any, g: torch.Tensor) -> Routing:
        logits, top_weights, top_index = router_output
        sig = logits.float().sigmoid()
        active = top_index.long()
        return Routing(
            scores=self.eligible_scores(logits),
            probs=_renormalise(sig),
            active=active,
            weights=top_weights.float(),
            rho=_renormalise(sig.gather(1, active)),
        )

    def shared_output(self, g: torch.Tensor) -> torch.Tensor:
        return self.block.shared_experts(g)


class GptOssLayer(HFSoftmaxLayer):
    """GPT-OSS: biased linear router, top-k on logits then softmax over the k (the renormalised softmax);
    interleaved fused experts, called with the same signature."""

    router_kind = "topk_softmax"


def _factory(cls: type[RoutedLayer], family: str, router_attr: str = "gate"):
    def make(name: str, index: int, block: nn.Module, parent: nn.Module) -> RoutedLayer | None:
        norm = getattr(parent, "post_attention_layernorm", None)
        router = getattr(block, router_attr, None)
        experts = getattr(block, "experts", None)
        if norm is None or router is None or experts is None:
            return None
        layer = cls(name, index, block, norm, router, experts)
        layer.family = family
        return layer

    return make


for _cls, _family in [
    ("MixtralSparseMoeBlock", "mixtral"),
    ("Qwen3MoeSparseMoeBlock", "qwen3_moe"),
    ("OlmoeSparseMoeBlock", "olmoe"),
]:
    register_family(_cls, _family, _factory(HFSoftmaxLayer, _family))
register_family("Qwen2MoeSparseMoeBlock", "qwen2_moe", _factory(Qwen2MoeLayer, "qwen2_moe"))
register_family("DeepseekV3MoE", "deepseek_v3", _factory(DeepseekV3Layer, "deepseek_v3"))
register_family("GptOssMLP", "gpt_oss", _factory(GptOssLayer, "gpt_oss", router_attr="router"))
