"""The RoutedLayer protocol and the registry of model families, keyed by module class name.

A family adapter explains one kind of routed MoE block to the engine: where its pre-norm,
router and experts are, how to turn the router's output into exact selection scores, the
full routing distribution, the active set and weights, and how to evaluate any expert
unweighted. Adding a family is one small entry (``register_family``). This module imports
no family: the transformers table (``adapters/families.py``) registers itself when
``atlas_tracking.adapters`` is imported, and the framework adapters of ``atlas_tracking.integrations``
are plugins, named under the ``atlas_tracking.families`` entry-point group and imported the first time
the registry is read (:func:`load_plugins`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import torch
from torch import nn

from atlas_tracking.receipts.geometry import angular, layer_normalize, rms_normalize


class NoRoutedLayersError(ValueError):
    """The model holds no module that any registered family adapter recognises."""


@dataclass
class Routing:
    """The router's decision for N tokens, in fp32 (docs/receipts.md#notation)."""

    scores: torch.Tensor
    """``[N, E]`` selection scores that top-k ranks; ``-inf`` marks ineligible experts."""
    probs: torch.Tensor
    """``[N, E]`` full routing distribution p_t."""
    active: torch.Tensor
    """``[N, k]`` active set R_t the model uses (int64)."""
    weights: torch.Tensor
    """``[N, k]`` the model's own combine weights for R_t (not renormalised; scaling included)."""
    rho: torch.Tensor
    """``[N, k]`` routing weights renormalised to sum to 1 over R_t."""
    dropped: torch.Tensor | None = None
    """``[N, k]`` routes the router chose but a capacity limit dropped (weight 0), when the layer drops."""


@dataclass
class RouteCount:
    """What one call of a layer's router chose, per expert, on the router's device (no host synchronisation)."""

    chosen: torch.Tensor | None = None
    """``[E]`` int64: the routes the router chose to each expert (dropped ones included); None when ``index`` says."""
    dropped: torch.Tensor | None = None
    """``[E]`` int64: of those, the routes a capacity limit dropped; None for a layer that never drops."""
    index: torch.Tensor | None = None
    """The router's own top-k expert ids (any shape, every id a route): the counter adds them into its counts in
    place, which makes no tensor (the cheapest form; ``chosen`` is then None)."""


def expert_counts(index: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``[E]`` int64 counts of the expert ids in ``index`` (any shape; ids below 0 are not counted), by an
    ``index_add_`` on the ids' device: unlike ``torch.bincount``, no host synchronisation.

    >>> expert_counts(torch.tensor([[0, 2], [2, -1]]), 4).tolist()
    [1, 0, 2, 0]
    """
    flat = index.reshape(-1).long()
    flat = torch.where(flat < 0, n_experts, flat)
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=index.device)
    return counts.index_add_(0, flat, torch.ones_like(flat))[:n_experts]


NORM_TYPES = ("rms", "layernorm")
"""The pre-norms a layer is read through (docs/receipts.md#notation, docs/receipts.md#layernorm-state)."""
LAYERNORM_CLASSES = ("LayerNorm", "FusedLayerNorm", "MixedFusedLayerNorm")
"""Class names of mean-centred LayerNorms outside ``torch.nn`` (Transformer Engine's, Megatron's and Apex's fused
ones); ``torch.nn.LayerNorm`` and its subclasses are recognised by type."""


def norm_type_of(norm: nn.Module) -> str:
    """``"layernorm"`` for a mean-centred LayerNorm (``torch.nn.LayerNorm`` or one of :data:`LAYERNORM_CLASSES`),
    ``"rms"`` for any other norm.

    >>> norm_type_of(nn.LayerNorm(4)), norm_type_of(nn.RMSNorm(4))
    ('layernorm', 'rms')
    """
    return "layernorm" if isinstance(norm, nn.LayerNorm) or type(norm).__name__ in LAYERNORM_CLASSES else "rms"


class RoutedLayer:
    """One routed MoE layer of a model, as the engine sees it.

    Subclasses implement ``routing`` (router output -> :class:`Routing`), ``expert_outputs``
    and, where present, ``shared_output``. The hook points are three modules: ``norm``
    (input x, output g), ``router`` (its forward output is the model's own routing) and
    ``block`` (its output is the layer's MoE update).
    """

    family: str = "generic"
    router_kind: str = "softmax"
    """'softmax' (logits ranked), 'sigmoid' (sigmoid + bias ranked) or 'topk_softmax'."""
    deterministic_routing: bool = True
    fusable: bool = True
    """The experts module is called as ``experts(x, top_k_index, top_k_weights)``, so a gate can
    evaluate the active fields inside the forward (see ReceiptsConfig.fuse_experts)."""
    sequence_first: bool = False
    """Hidden states are ``[seq, batch, d]`` (Megatron) rather than ``[batch, seq, d]``."""
    norm_type: str = "rms"
    """The pre-norm's kind (one of :data:`NORM_TYPES`): ``"rms"``, ``z = x / rms(x)`` and ``g = Gamma z``, or
    ``"layernorm"``, ``z = (x - mean(x)) / std(x)`` and ``g = Gamma z + beta`` (docs/receipts.md#layernorm-state).
    Set from the norm module by :func:`norm_type_of` unless an adapter knows better."""
    zero_experts: frozenset[int] = frozenset()
    """Global ids of the layer's zero-computation experts (identity or no-op slots): routable slots that carry
    no field, left out of co-active pairs, V2 distances and content drift (docs/receipts.md#zero-computation-experts)."""

    def __init__(self, name: str, index: int, block: nn.Module, norm: nn.Module, router: nn.Module, experts: nn.Module):
        self.name = name
        self.index = index
        self.block = block
        self.norm = norm
        self.router = router
        self.experts = experts
        self.ordinal = -1
        self.norm_type = norm_type_of(norm)

    # --- shape -----------------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        raise NotImplementedError

    @property
    def top_k(self) -> int:
        raise NotImplementedError

    @property
    def hidden_size(self) -> int:
        shape = getattr(self.norm.weight, "ds_shape", None)  # a ZeRO-3 partition keeps its full shape there
        return int(shape[0]) if shape is not None else int(self.gamma().shape[0])

    @property
    def norm_eps(self) -> float:
        for attr in ("variance_epsilon", "eps", "epsilon"):
            if hasattr(self.norm, attr):
                return float(getattr(self.norm, attr))
        raise AttributeError(f"cannot find the epsilon of norm module {type(self.norm).__name__} in {self.name}")

    def gamma(self) -> torch.Tensor:
        """The norm's gain Gamma (fp32), so that ``g = Gamma * z`` (``+ beta`` for a LayerNorm)."""
        return self.norm.weight.float()

    def beta(self) -> torch.Tensor | None:
        """The LayerNorm's bias beta (fp32); None for an RMS norm or a LayerNorm without a bias."""
        bias = getattr(self.norm, "bias", None) if self.norm_type == "layernorm" else None
        return None if bias is None else bias.float()

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """The pre-gain state ``z`` of norm inputs ``x``, in fp32 with the norm's own epsilon."""
        normalize = layer_normalize if self.norm_type == "layernorm" else rms_normalize
        return normalize(x, self.norm_eps)

    def direction(self, x: torch.Tensor) -> torch.Tensor:
        """The angular state ``zh = z / ||z||`` of norm inputs ``x`` (fp32): the normalisation's positive scale
        cancels, so it is the direction of ``x`` (of ``x - mean(x)`` for a LayerNorm)."""
        x = x.float()
        return angular(x - x.mean(-1, keepdim=True) if self.norm_type == "layernorm" else x)

    def gain(self, z: torch.Tensor) -> torch.Tensor:
        """The gate input ``g = Gamma z`` (``Gamma z + beta`` for a LayerNorm with a bias), in fp32."""
        g = self.gamma() * z
        beta = self.beta()
        return g if beta is None else g + beta

    def router_rows(self) -> torch.Tensor | None:
        """``[E, d]`` the router's row of each routed expert in gate-input space (``logit_e = w_e . g + b_e``), fp32:
        the first E rows of the router's one two-dimensional parameter of width d (routers that also score shared
        experts hold them after the routed ones); None where the router holds no such parameter, or more than one
        (docs/receipts.md#router-expert-coupling).

        >>> class Bare(RoutedLayer):
        ...     num_experts = 3   # an adapter knows its experts
        >>> Bare("b", 0, nn.Identity(), nn.RMSNorm(4), nn.Linear(4, 3, bias=False), nn.Identity()).router_rows().shape
        torch.Size([3, 4])
        """
        d, e = self.hidden_size, self.num_experts
        found = [p for _, p in self.router.named_parameters() if p.dim() == 2 and p.shape[1] == d and p.shape[0] >= e]
        return found[0][:e].detach().float() if len(found) == 1 else None

    # --- routing ---------------------------------------------------------------------------
    def routing(self, router_output: Any, g: torch.Tensor) -> Routing:
        """Turn the router's own forward output for gate inputs ``g [N, d]`` into a :class:`Routing`."""
        raise NotImplementedError

    def router_logits(self, router_output: Any, routing: Routing) -> torch.Tensor:
        """The router's raw logits (checked for NaN/Inf at every gate)."""
        return router_output[0] if isinstance(router_output, tuple) else router_output

    def route(self, g: torch.Tensor) -> Routing:
        """Route arbitrary gate inputs through this layer's router (its own forward, no hooks)."""
        return self.routing(self.router.forward(g.reshape(-1, g.shape[-1])), g)

    def route_active(self, g: torch.Tensor) -> torch.Tensor:
        """The active sets ``[N, k]`` that :meth:`route` gives, where nothing else of the routing is needed."""
        return self.route(g).active

    def count_routes(self, router_inputs: tuple, router_output: Any) -> RouteCount:
        """Per expert, the routes the router's own forward chose (``router_output``, for the inputs it was called
        with), for the training-batch load between gates (docs/telemetry.md#what-is-counted).

        The default reads the whole :meth:`routing` (its active set, and its ``dropped`` routes where a capacity
        limit drops); an adapter whose router output holds the choice reads it directly, which costs less."""
        g = router_inputs[0]
        routing = self.routing(router_output, g.reshape(-1, g.shape[-1]))
        if routing.dropped is None:
            return RouteCount(index=routing.active)
        return RouteCount(index=routing.active, dropped=expert_counts(
            routing.active.masked_fill(~routing.dropped, -1), self.num_experts))

    def routes_replicated_on(self) -> Any:
        """A process group whose members route the very same tokens through this layer (a tensor-parallel group
        whose ranks all hold the whole sequence), or None: the training-batch counts are then taken on its first
        rank only, so that one token is counted once (docs/telemetry.md#how-it-is-reduced)."""
        return None

    # --- experts ---------------------------------------------------------------------------
    experts_forward: Any = None
    """The experts' own forward while a gate stands in for it (set by the capture); None: call the module."""

    def pair_outputs(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Raw (unweighted) output of expert ``experts[i]`` (a global id held by this process) at gate input
        ``rows[i]``: ``[M, d]``.

        Uses the model's own experts module with one (token, expert) pair per row and unit
        weight, so the arithmetic is the model's own (whatever experts implementation it uses).
        """
        ones = torch.ones(len(experts), 1, dtype=rows.dtype, device=rows.device)
        call = self.experts_forward if self.experts_forward is not None else self.experts
        return call(rows, experts.view(-1, 1), ones)

    def grouped_outputs(self, hidden: torch.Tensor, index: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]]
                        ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """The unweighted products ``[N, k, d]`` the experts' own forward sums for ``experts(hidden, index, weights)``,
        and the raw outputs ``[R, m, d]`` of each group of further ``pairs`` (rows ``[R, d]``, experts ``[R, m]``), in
        one pass; None where the adapter cannot read the experts' own products (the capture then evaluates the active
        set one pair a row, :meth:`pair_outputs`). The default reads none."""
        return None

    def grouped_pair_outputs(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor] | None:
        """The raw outputs of ``pairs`` alone, as :meth:`grouped_outputs` computes its further pairs (all of them in
        one pass), where the adapter reads the experts' own products and they pay to be pooled over micro-batches
        (docs/receipts.md#pooled-competitors); None otherwise. The default reads none."""
        return None

    def pools_pairs(self) -> bool:
        """Whether :meth:`grouped_pair_outputs` answers and pooling the competitors pays (their products do not
        already ride with the active set's while the experts' weights are in cache). The default: no."""
        return False

    def expert_outputs(self, g: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Raw (unweighted) outputs ``u_e(g_t)`` for ``experts [N, m]``: returns ``[N, m, d]``."""
        n, m = experts.shape
        rows = g.reshape(n, 1, -1).expand(n, m, g.shape[-1]).reshape(n * m, -1)
        return self.pair_outputs(rows, experts.reshape(-1)).view(n, m, -1)

    def expert_placement(self) -> tuple[Any, torch.Tensor] | None:
        """``(group, owner)`` when the layer's experts are spread over an expert-parallel process group:
        ``owner[e]`` is the rank within ``group`` that holds expert ``e`` (``pair_outputs`` then answers for
        the experts of this process only). None when every expert is held by this process."""
        return None

    def gate_context(self) -> contextlib.AbstractContextManager:
        """Entered for the whole gate (e.g. to make a sampled router deterministic)."""
        return contextlib.nullcontext()

    def seed_router(self, seed: int) -> None:
        """Called during a gate right before each call of the router, with a seed drawn from the micro-batch's
        canary windows, this layer's ordinal and ``receipts.seed`` (docs/distributed.md#random-routing): a
        router that draws random numbers (DeepSpeed's random token selection) seeds its draws here, so every
        world size draws the same numbers for the same micro-batch. The default draws nothing."""

    def shared_output(self, g: torch.Tensor) -> torch.Tensor | None:
        """Output of always-on shared experts at ``g [N, d]`` (gated as the model gates it), or None."""
        return None

    def block_output(self, output: Any) -> torch.Tensor:
        """The layer's MoE update from the block's forward output."""
        return output[0] if isinstance(output, tuple) else output

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "index": self.index,
            "family": self.family,
            "router": self.router_kind,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "hidden_size": self.hidden_size,
        }


Factory = Callable[[str, int, nn.Module, nn.Module], "RoutedLayer | None"]
"""(block name, decoder layer index, block module, parent module) -> RoutedLayer or None (not this family)."""

_REGISTRY: dict[str, tuple[str, Factory]] = {}
RECIPE = "docs/extending.md#your-own-moe-module"
"""Where the recipe for registering a hand-written MoE lives (named in discovery errors)."""
_MOE_LOOKING = ("moe", "expert", "router", "sparse", "topk", "gating")


PLUGIN_GROUP = "atlas_tracking.families"
"""Entry-point group of modules that register family adapters when imported (the integrations)."""


@functools.lru_cache(maxsize=1)
def load_plugins() -> tuple[str, ...]:
    """Import every module named under :data:`PLUGIN_GROUP` once (each registers its blocks); their names.

    A plugin that fails to import is a warning naming it, never an error: the other families stay readable.
    """
    names = []
    for entry in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        try:
            entry.load()
        except Exception as exc:  # a broken plugin must not stop the engine from reading the other families
            warnings.warn(f"atlas: family plugin {entry.name} ({entry.value}) failed to import: "
                          f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
            continue
        names.append(entry.name)
    return tuple(names)


def register_family(block_class_name: str, family: str, factory: Factory) -> None:
    """Register an adapter factory for MoE blocks whose class is named ``block_class_name``.

    The name may be qualified with its module (``"torchtitan.models.moe.moe.MoE"``) to tell apart
    frameworks whose blocks share a class name; a qualified entry is tried before a plain one.
    """
    _REGISTRY[block_class_name] = (family, factory)


def registered_families() -> dict[str, str]:
    """Block class name -> family name, for every registered adapter."""
    load_plugins()
    return {cls: fam for cls, (fam, _) in _REGISTRY.items()}


def _layer_index(name: str) -> int:
    for part in reversed(name.split(".")):
        if part.isdigit():
            return int(part)
    return -1


def _factories(module: nn.Module) -> list[Factory]:
    cls = type(module)
    keys = (f"{cls.__module__}.{cls.__name__}", cls.__name__)
    return [_REGISTRY[key][1] for key in keys if key in _REGISTRY]


def _iter_blocks(model: nn.Module) -> Iterator[tuple[str, nn.Module, nn.Module, list[Factory]]]:
    load_plugins()
    modules = dict(model.named_modules())
    for name, module in modules.items():
        factories = _factories(module)
        if factories:
            parent_name = name.rsplit(".", 1)[0] if "." in name else ""
            yield name, module, modules.get(parent_name, model), factories


def moe_looking_modules(model: nn.Module, limit: int = 8) -> list[str]:
    """``name (Class)`` of modules that look like MoE blocks (an ``experts`` child, or an MoE-ish class name),
    one per class, outermost first; the discovery error lists them."""
    seen: dict[str, str] = {}
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls in seen or not name:
            continue
        if hasattr(module, "experts") or any(word in cls.lower() for word in _MOE_LOOKING):
            seen[cls] = f"{name} ({cls})"
    found = list(seen.values())
    return found[:limit] + ([f"... {len(found) - limit} more classes"] if len(found) > limit else [])


def known_examples(model_class: str, count: int = 3) -> list[str]:
    """A few registered block classes to name in an error: those of the model's own family first.

    >>> known_examples("Qwen3ForCausalLM", count=1)
    ['Qwen3MoeSparseMoeBlock']
    """
    family = model_class.split("For", 1)[0].lower()
    names = sorted(_REGISTRY)
    related = [n for n in names if family and n.lower().startswith(family)]
    return (related + [n for n in names if n not in related])[:count]


def find_routed_layers(model: nn.Module) -> list[RoutedLayer]:
    """Every routed MoE layer of ``model`` in forward order; a clear error if there is none.

    The error lists the MoE-looking modules it saw, so a hand-written MoE can be registered
    (``atlas_tracking.register_family``; see the recipe in ``docs/extending.md``).
    """
    layers: list[RoutedLayer] = []
    for name, block, parent, factories in _iter_blocks(model):
        for factory in factories:
            layer = factory(name, _layer_index(name), block, parent)
            if layer is not None:
                layers.append(layer)
                break
    if not layers:
        looked = moe_looking_modules(model)
        seen = f"; MoE-looking modules it saw: {', '.join(looked)}" if looked else "; it saw no MoE-looking module"
        raise NoRoutedLayersError(
            f"no routed MoE layer found in {type(model).__name__}: to read your own MoE block, register an adapter "
            f"with atlas_tracking.register_family (recipe: {RECIPE}){seen}; "
            f"searched for {len(_REGISTRY)} known block classes ({', '.join(known_examples(type(model).__name__))}, ...)"
        )
    for i, layer in enumerate(layers):
        layer.ordinal = i
    return layers
