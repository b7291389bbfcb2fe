"""DeepSpeed: an adapter for ``deepspeed.moe.layer.MoE`` and the plain-loop entry point.

The layer's router is its ``TopKGate`` (``.deepspeed_moe.gate``, weights ``.wg``); selection scores
are its fp32 logits, the routing distribution their softmax. The model's own dispatch is read
from the gate's sparse routes: routes a capacity limit dropped (index -1) keep the router's
top-k choice in the active set with weight 0, and are counted as ``dropped_routes``. During a
gate the top-2 Gumbel sampling of the second expert is switched off (deterministic routing) and
random token selection draws from a seed of each micro-batch and layer, the same at every world
size (``seed_router``). A residual MoE (``use_residual``) contributes its ``mlp`` through the
``coefficient`` mix as the transport baseline. With ``ep_size > 1`` rank ``r``
of the layer's expert-parallel group holds experts ``r * n_local .. (r + 1) * n_local - 1``
(``expert_placement``); a gate asks the owning rank for the fields of experts held elsewhere
(``atlas_tracking.engine.fields``). ``zero3_gathered`` gathers ZeRO-3 partitions for ``atlas_tracking.engine.sharding``.

DeepSpeed has no norm inside the MoE layer: the pre-norm is found in the parent block (one
RMSNorm/LayerNorm-like child, or a common name) or given with ``norms={"blocks.0.moe": block.norm2}``.
In a loop under ``deepspeed.initialize`` (``examples/deepspeed_loop.py`` runs it)::

    from atlas_tracking.integrations.deepspeed import deepspeed_layers
    layers = deepspeed_layers(engine.module)
    gate = AtlasGate(engine.module, canary, "atlas.yaml", layers=layers)
    gate.run(step, loss=val_loss)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from atlas_tracking.adapters.base import (
    NoRoutedLayersError,
    RouteCount,
    RoutedLayer,
    Routing,
    _layer_index,
    expert_counts,
    register_family,
)

NORM_NAMES = ("post_attention_layernorm", "pre_mlp_layernorm", "ln_2", "norm2", "mlp_norm", "ffn_norm", "norm")


def _is_norm(module: nn.Module) -> bool:
    return hasattr(module, "weight") and any(hasattr(module, a) for a in ("eps", "variance_epsilon", "epsilon"))


def find_pre_norm(parent: nn.Module, block: nn.Module) -> nn.Module | None:
    """The norm in front of an MoE layer: a known attribute name, else the only norm-like child."""
    for name in NORM_NAMES:
        module = getattr(parent, name, None)
        if isinstance(module, nn.Module) and _is_norm(module):
            return module
    norms = [m for m in parent.children() if m is not block and _is_norm(m)]
    return norms[0] if len(norms) == 1 else None


class DeepSpeedMoELayer(RoutedLayer):
    """``deepspeed.moe.layer.MoE`` as a routed layer."""

    family = "deepspeed"
    router_kind = "softmax"
    fusable = False

    @property
    def moe(self) -> nn.Module:
        return self.block.deepspeed_moe

    @property
    def num_experts(self) -> int:
        return int(self.router.wg.weight.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.router.k)

    @property
    def norm_eps(self) -> float:
        eps = getattr(self.norm, "eps", getattr(self.norm, "variance_epsilon", None))
        return float(eps) if eps is not None else float(torch.finfo(self.norm.weight.dtype).eps)

    def gate_context(self) -> contextlib.AbstractContextManager:
        return _deterministic_gate(self.router)

    def seed_router(self, seed: int) -> None:
        """Random token selection (``use_rts``, the default at top-1) ranks the tokens over an expert's capacity
        by a uniform draw on the router's device: seeded per micro-batch and layer, it drops the same tokens
        at every world size (docs/distributed.md#random-routing)."""
        device_generator(self.router.wg.weight.device).manual_seed(seed)

    def _coefficients(self, g: torch.Tensor) -> torch.Tensor | None:
        if not getattr(self.block, "use_residual", False):
            return None
        return F.softmax(self.block.coefficient(g), dim=-1).float()

    def _sparse_routes(self, router_output: Any) -> tuple:
        if not (isinstance(router_output, tuple) and len(router_output) == 7):
            raise RuntimeError(
                f"{self.name}: this DeepSpeed version's TopKGate did not return sparse routes "
                "(l_aux, capacity, E, indices, locations, gates, exp_counts); supported: deepspeed>=0.16"
            )
        return router_output

    def count_routes(self, router_inputs: tuple, router_output: Any) -> RouteCount:
        """The gate's ``exp_counts`` (its choice before the capacity limit) and, of those, the routes its sparse
        indices flag as dropped (-1)."""
        routes = self._sparse_routes(router_output)
        chosen = routes[6].to(torch.int64)
        return RouteCount(chosen, chosen - expert_counts(routes[3], self.num_experts))

    def routes_replicated_on(self) -> Any:
        """With a tensor-parallel ``mpu`` every rank of a tensor-parallel group routes the same tokens (DeepSpeed
        drops the duplicates after routing): its group."""
        from deepspeed.utils import groups
        from deepspeed.utils.bwc import bwc_tensor_model_parallel_group, bwc_tensor_model_parallel_world_size

        if groups.mpu is None or bwc_tensor_model_parallel_world_size(groups.mpu) == 1:
            return None
        return bwc_tensor_model_parallel_group(groups.mpu)

    def routing(self, router_output: Any, g: torch.Tensor) -> Routing:
        indices, gates = self._sparse_routes(router_output)[3], router_output[5]
        logits = F.linear(g.float(), self.router.wg.weight.float())
        probs = torch.softmax(logits, dim=-1)
        top = torch.topk(logits, self.top_k, dim=1).indices
        model_idx = indices.t().long()
        dropped = model_idx < 0
        active = torch.where(dropped, top, model_idx)
        weights = gates.t().float()
        coef = self._coefficients(g)
        if coef is not None:
            weights = weights * coef[:, :1]
        rho = probs.gather(1, active)
        return Routing(scores=logits, probs=probs, active=active, weights=weights,
                       rho=rho / rho.sum(dim=1, keepdim=True), dropped=dropped)

    def router_logits(self, router_output: Any, routing: Routing) -> torch.Tensor:
        return routing.scores

    def route(self, g: torch.Tensor) -> Routing:
        """The ``TopKGate``'s choice at any gate inputs, computed from its logits without calling it: its
        capacity limit belongs to a dispatched micro-batch, not to re-routed states, and with
        ``drop_tokens=False`` it sizes the capacity by an ``all_reduce`` over the expert-parallel group,
        which only some ranks would reach. The choice equals the gate's (top-k of the logits, the second
        expert not sampled during a gate); weights as it combines them (renormalised over the k for k > 1)."""
        g = g.reshape(-1, g.shape[-1])
        logits = F.linear(g.float(), self.router.wg.weight.float())
        probs = torch.softmax(logits, dim=-1)
        active = torch.topk(logits, self.top_k, dim=1).indices
        top = probs.gather(1, active)
        rho = top / top.sum(dim=1, keepdim=True)
        weights = top if self.top_k == 1 else rho
        coef = self._coefficients(g)
        if coef is not None:
            weights = weights * coef[:, :1]
        return Routing(scores=logits, probs=probs, active=active, weights=weights, rho=rho)

    def expert_placement(self) -> tuple[Any, torch.Tensor] | None:
        """With ``ep_size > 1`` expert ``e`` is held by rank ``e // num_local_experts`` of the layer's EP group."""
        ep_size = int(getattr(self.moe, "ep_size", 1))
        if ep_size == 1:
            return None
        if self.moe.ep_group is None:
            raise RuntimeError(f"{self.name}: ep_size={ep_size} but the layer has no expert-parallel group yet; "
                               "measure after deepspeed.initialize (which creates it)")
        return self.moe.ep_group, torch.arange(self.num_experts) // int(self.moe.num_local_experts)

    def pair_outputs(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """One expert module of this process at a time over the rows asking for it (one GEMM chain per expert)."""
        local = self.moe.experts.deepspeed_experts
        first = 0
        if int(getattr(self.moe, "ep_size", 1)) > 1:
            first = torch.distributed.get_rank(group=self.moe.ep_group) * len(local)
        out = None
        for j, expert in enumerate(local):
            sel = torch.nonzero(experts == first + j).flatten()
            if sel.numel() == 0:
                continue
            y = expert(rows.index_select(0, sel))
            y = y[0] if isinstance(y, tuple) else y
            if out is None:
                out = rows.new_zeros((rows.shape[0], y.shape[-1]), dtype=y.dtype)
            out.index_copy_(0, sel, y)
        return out if out is not None else torch.zeros_like(rows)

    def shared_output(self, g: torch.Tensor) -> torch.Tensor | None:
        coef = self._coefficients(g)
        if coef is None:
            return None
        mlp = self.block.mlp(g)
        mlp = mlp[0] if isinstance(mlp, tuple) else mlp
        return mlp * coef[:, 1:].to(mlp.dtype)


def device_generator(device: torch.device) -> torch.Generator:
    """The default generator torch draws from on ``device``, the one random token selection draws from.

    >>> device_generator(torch.device("cpu")) is torch.default_generator
    True
    """
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    return module.default_generators[device.index if device.index is not None else module.current_device()]


@contextlib.contextmanager
def _deterministic_gate(gate: nn.Module) -> Iterator[None]:
    """No Gumbel sampling of the second expert during a gate, and the generator that random token selection
    draws from (seeded before each router call by ``seed_router``) given back its state afterwards, so the
    training run's random stream is the one it would have been without the gate."""
    sampling = getattr(gate, "top2_2nd_expert_sampling", False)
    generator = device_generator(gate.wg.weight.device)
    state = generator.get_state()
    gate.top2_2nd_expert_sampling = False
    try:
        yield
    finally:
        gate.top2_2nd_expert_sampling = sampling
        generator.set_state(state)


def _make(name: str, index: int, block: nn.Module, parent: nn.Module, norm: nn.Module | None = None):
    if not hasattr(block, "deepspeed_moe"):
        return None
    norm = norm if norm is not None else find_pre_norm(parent, block)
    if norm is None:
        raise NoRoutedLayersError(
            f"DeepSpeed MoE layer {name}: cannot tell which norm feeds it (looked for {', '.join(NORM_NAMES)} or a "
            "single norm-like child of its parent); pass deepspeed_layers(model, norms={name: <norm module>})"
        )
    return DeepSpeedMoELayer(name, index, block, norm, block.deepspeed_moe.gate, block.deepspeed_moe.experts)


register_family("MoE", "deepspeed", _make)


def deepspeed_layers(model: nn.Module, norms: dict[str, nn.Module] | None = None) -> list[RoutedLayer]:
    """Every ``deepspeed.moe.layer.MoE`` of ``model`` (a DeepSpeed engine's ``.module`` works too)."""
    model = getattr(model, "module", model)
    modules = dict(model.named_modules())
    layers: list[RoutedLayer] = []
    for name, block in modules.items():
        if type(block).__name__ == "MoE" and hasattr(block, "deepspeed_moe"):
            parent = modules.get(name.rsplit(".", 1)[0] if "." in name else "", model)
            layer = _make(name, _layer_index(name), block, parent, (norms or {}).get(name))
            layers.append(layer)
    if not layers:
        raise NoRoutedLayersError(f"no deepspeed.moe.layer.MoE found in {type(model).__name__}")
    for i, layer in enumerate(layers):
        layer.ordinal = i
    return layers


