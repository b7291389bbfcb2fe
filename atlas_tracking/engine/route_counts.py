"""Counting hooks: the routes each routed layer's router chose in every training forward, between gates.

A :class:`RouteCounter` puts one forward hook on the router of every routed layer (the same adapters a gate
reads). In each training forward the hook adds the router's own choice, per expert
(:meth:`~atlas_tracking.adapters.base.RoutedLayer.count_routes`), to counts kept on the router's device: an
``index_add_``, no host synchronisation. A router call is counted when the router is in training mode, outside
a gate (:meth:`RouteCounter.paused`), with gradients on (:func:`without_gradients`: a log-probability pass or a
generation under ``torch.no_grad()`` reads the model, it does not train it) and outside a backward pass: an
activation checkpoint that runs the forward again during the backward is not a second forward, so it is never
counted twice (reentrant and non-reentrant checkpointing alike: both recompute inside the autograd engine's
backward), nor is the forward a pipeline stage runs once to learn its shapes
(:func:`in_pipeline_metadata_inference`).

:meth:`RouteCounter.collect` closes a logging interval on every process at once: one ``all_reduce`` over the
default process group of one int64 tensor (every layer's chosen and dropped routes, tokens, router calls
and, where experts are spread over an expert-parallel group, the routes each process received), one copy to
the host, then the counts start again from zero. Layers are labelled with the model's own layer numbers, so a
pipeline stage's layers and another stage's meet in one table (built at the first interval from every
process's layers). docs/telemetry.md says what is counted, where, and how it is reduced.

Example:
    >>> import torch
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> from atlas_tracking.adapters import find_routed_layers
    >>> _ = torch.manual_seed(0)
    >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ...     head_dim=8, num_experts=8, num_experts_per_tok=2))
    >>> counter = RouteCounter(find_routed_layers(model)).attach()
    >>> _ = model.train()(torch.randint(0, 64, (2, 16)))        # a training forward: counted
    >>> _ = model.eval()(torch.randint(0, 64, (2, 16)))         # an evaluation forward: not counted
    >>> with torch.no_grad():                                   # a log-probability pass in training mode: not counted
    ...     _ = model.train()(torch.randint(0, 64, (2, 16)))
    >>> interval = counter.collect()
    >>> [(row["layer"], row["tokens"], sum(row["load"])) for row in interval.layers]
    [(0, 32, 64), (1, 32, 64)]
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from atlas_tracking.adapters.base import RouteCount, RoutedLayer
from atlas_tracking.engine.collectives import checkpoint
from atlas_tracking.engine.param_reference import collective_device

log = logging.getLogger("atlas_tracking")


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (where activation checkpointing
    recomputes a forward)."""
    return torch._C._current_graph_task_id() != -1


def in_recorded_function_forward() -> bool:
    """True inside the ``forward`` of an autograd function that autograd records on this thread (one applied with
    gradients on, to an input that requires them): where torch's reentrant checkpoint (``use_reentrant=True``),
    DeepSpeed's and Megatron's recomputation run a training forward with gradients off. The same function applied
    under ``torch.no_grad()`` is not recorded. It looks for a caller whose first argument is an autograd function's
    context with a place in the graph:

    >>> class Twice(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         return x * 2 if in_recorded_function_forward() else x
    >>> x = torch.ones(1, requires_grad=True)
    >>> Twice.apply(x).item(), in_recorded_function_forward()
    (2.0, False)
    >>> with torch.no_grad():
    ...     Twice.apply(x).item()
    1.0
    """
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "ctx":
            ctx = frame.f_locals.get("ctx")
            if isinstance(ctx, torch.autograd.function.FunctionCtx) and getattr(ctx, "next_functions", ()):
                return True
        frame = frame.f_back
    return False


def without_gradients() -> bool:
    """True when the router runs with gradients off (``torch.no_grad()``, ``torch.inference_mode()``) outside a
    recorded autograd function's forward (:func:`in_recorded_function_forward`): a pass that reads the model in
    training mode (a trainer's old-policy or reference log-probabilities, a generation) and does not train it.

    >>> with torch.no_grad():
    ...     without_gradients()
    True
    >>> without_gradients()
    False
    """
    return not torch.is_grad_enabled() and not in_recorded_function_forward()


def in_pipeline_metadata_inference() -> bool:
    """True inside the forward a ``torch.distributed.pipelining.PipelineStage`` runs at its first step to learn the
    shapes it sends (the first micro-batch on the first stage, uninitialised tensors of the received shape on the
    others), before the schedule runs every micro-batch: no training forward.

    It looks for ``PipelineStage._forward_metadata_inference`` among the callers, only once that module is imported:

    >>> in_pipeline_metadata_inference()
    False
    """
    stage = sys.modules.get("torch.distributed.pipelining.stage")
    inference = getattr(getattr(stage, "PipelineStage", None), "_forward_metadata_inference", None)
    code = getattr(inference, "__code__", None)
    frame = sys._getframe(1) if code is not None else None
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@dataclass
class _Local:
    """One routed layer of this process: its counts since the last interval."""

    layer: RoutedLayer
    key: tuple[int, int]
    """(the model's layer number, position among this process's layers of that number)."""
    chosen: torch.Tensor | None = None
    dropped: torch.Tensor | None = None
    one: torch.Tensor | None = None
    """A scalar 1 on the counts' device, expanded (no copy) as the source of each call's ``index_add_``."""
    tokens: int = 0
    calls: int = 0
    counts: bool | None = None
    """False on the ranks of a group that routes the same tokens other than its first (counted once); None until
    the first call asks the layer."""

    def counting(self) -> bool:
        if self.counts is None:
            group = self.layer.routes_replicated_on()
            self.counts = group is None or torch.distributed.get_rank(group=group) == 0
        return self.counts


@dataclass(frozen=True)
class TableRow:
    """One routed layer of the model, as every process agrees on it."""

    layer: int
    """The model's own layer number."""
    slot: int
    """Its position among the model's routed layers of that number (0 but for blocks sharing a number)."""
    name: str
    """Its module path, on the first process that holds it."""
    experts: int
    ep_ranks: tuple[int, ...] = ()
    """The global ranks that hold its experts where they are spread over expert-parallel groups (empty: none)."""


@dataclass
class Interval:
    """The routes of one logging interval, summed over every process (host values)."""

    layers: list[dict[str, Any]]
    """Per routed layer, in layer order: ``layer``, ``name``, ``load`` (routes per expert), ``dropped`` (None for
    a layer that never drops), ``tokens``, ``calls`` and, for an expert-parallel layer, ``ep_ranks`` (the global
    ranks holding its experts) and ``ep_tokens`` (the routes each of them received)."""
    errors: list[str] = field(default_factory=list)
    """Router calls that could not be counted (each layer's first error), on this process."""


class RouteCounter:
    """Counting hooks on every routed layer's router; see the module docstring."""

    def __init__(self, layers: list[RoutedLayer]):
        self._local: list[_Local] = []
        seen: dict[int, int] = {}
        for layer in layers:
            slot = seen.get(layer.index, 0)
            seen[layer.index] = slot + 1
            self._local.append(_Local(layer, (int(layer.index), slot)))
        self._handles: list[Any] = []
        self._paused = 0
        self._errors: dict[str, str] = {}
        self.table: list[TableRow] | None = None
        """Every process's routed layers, agreed at the first interval."""
        self._owners: dict[tuple[int, int], torch.Tensor] = {}

    # --- hooks ---------------------------------------------------------------------------------
    def attach(self) -> RouteCounter:
        if not self._handles:
            self._handles = [entry.layer.router.register_forward_hook(self._hook(entry), with_kwargs=True)
                             for entry in self._local]
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No router call is counted inside the block (a gate's own forwards)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _hook(self, entry: _Local):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if (self._paused or not module.training or in_backward() or not entry.counting()
                    or without_gradients() or in_pipeline_metadata_inference()):
                return
            inputs = args or tuple(kwargs.values())
            try:
                self._add(entry, entry.layer.count_routes(inputs, output))
                entry.tokens += inputs[0].numel() // inputs[0].shape[-1]
                entry.calls += 1
            except Exception as exc:  # counting must never stop training; the interval says what was missed
                if entry.layer.name not in self._errors:
                    self._errors[entry.layer.name] = f"{type(exc).__name__}: {exc}"
                    log.warning("atlas: cannot count the routes of %s (%s: %s); its training-batch load misses "
                                "these calls", entry.layer.name, type(exc).__name__, exc)
        return hook

    @staticmethod
    def _add(entry: _Local, count: RouteCount) -> None:
        """Add one router call's routes to the layer's counts, in place on the router's device."""
        given = count.index if count.index is not None else count.chosen
        if entry.chosen is None or entry.chosen.device != given.device:
            entry.chosen = torch.zeros(int(entry.layer.num_experts), dtype=torch.int64, device=given.device)
            entry.one = torch.ones((), dtype=torch.int64, device=given.device)
        if count.index is not None:
            ids = count.index.reshape(-1)
            entry.chosen.index_add_(0, ids, entry.one.expand(ids.numel()))
        else:
            entry.chosen += count.chosen
        dropped = count.dropped
        if dropped is not None:
            if entry.dropped is None or entry.dropped.device != dropped.device:
                entry.dropped = torch.zeros_like(dropped, dtype=torch.int64)
            entry.dropped += dropped

    # --- the interval --------------------------------------------------------------------------
    def pending(self) -> bool:
        """Router calls were counted on this process since the last interval."""
        return any(entry.calls for entry in self._local)

    def _agree(self) -> list[TableRow]:
        """The table of every process's routed layers (collective, once)."""
        mine = []
        for entry in self._local:
            placement = self._placement(entry)
            held = tuple(sorted(set(placement.tolist()))) if placement is not None else ()
            mine.append((entry.key, entry.layer.name, int(entry.layer.num_experts), held))
            if placement is not None:
                self._owners[entry.key] = placement
        every = [mine]
        if _distributed() and torch.distributed.get_world_size() > 1:
            every = [None] * torch.distributed.get_world_size()
            checkpoint("the routed-layer table")
            torch.distributed.all_gather_object(every, mine)
        rows: dict[tuple[int, int], TableRow] = {}
        for held in every:
            for key, name, experts, ranks in held:
                row = rows.get(key)
                if row is not None and row.experts != experts:
                    raise ValueError(f"routed layer {key[0]} has {row.experts} experts on one process and {experts} "
                                     "on another: the processes do not hold the same model")
                union = tuple(sorted(set(ranks) | set(row.ep_ranks if row else ())))
                rows[key] = TableRow(key[0], key[1], row.name if row else name, experts, union)
        return [rows[key] for key in sorted(rows)]

    @staticmethod
    def _placement(entry: _Local) -> torch.Tensor | None:
        """Per expert, the global rank of the process holding it, for an expert-parallel layer (else None)."""
        try:
            placement = entry.layer.expert_placement()
        except RuntimeError:  # no expert-parallel group (yet): counted as held here
            return None
        if placement is None:
            return None
        group, owner = placement
        ranks = torch.tensor(torch.distributed.get_process_group_ranks(group), dtype=torch.int64)
        return ranks[owner.long()]

    def collect(self) -> Interval:
        """The counts since the last interval, summed over every process; then the counts start from zero.

        Collective under ``torch.distributed``: every process calls it at the same optimizer step."""
        if self.table is None:
            self.table = self._agree()
        distributed = _distributed() and torch.distributed.get_world_size() > 1
        world = torch.distributed.get_world_size() if distributed else 1
        width = max((row.experts for row in self.table), default=0)
        ep_width = world if any(row.ep_ranks for row in self.table) else 0
        extra = 4  # tokens, calls, whether the layer drops, whether it counted here
        device = next((e.chosen.device for e in self._local if e.chosen is not None), torch.device("cpu"))
        if distributed:
            device = collective_device()  # the process group's: this GPU under NCCL, the host under gloo
        stack = torch.zeros(len(self.table), 2 * width + extra + ep_width, dtype=torch.int64, device=device)
        position = {(row.layer, row.slot): i for i, row in enumerate(self.table)}
        for entry in self._local:
            if not entry.counting():
                continue
            i, experts = position[entry.key], int(entry.layer.num_experts)
            if entry.chosen is not None:
                stack[i, :experts] = entry.chosen.to(device)
            if entry.dropped is not None:
                stack[i, width:width + experts] = entry.dropped.to(device)
                stack[i, 2 * width + 2] = 1
            stack[i, 2 * width] = entry.tokens
            stack[i, 2 * width + 1] = entry.calls
            stack[i, 2 * width + 3] = 1
            owners = self._owners.get(entry.key)
            if owners is not None and entry.chosen is not None:
                kept = entry.chosen - (entry.dropped if entry.dropped is not None else 0)
                received = torch.zeros(world, dtype=torch.int64, device=kept.device)
                stack[i, 2 * width + extra:] = received.index_add_(0, owners.to(kept.device), kept).to(device)
        if distributed:
            checkpoint("the training-batch load")
            torch.distributed.all_reduce(stack)
        host = stack.cpu().tolist()
        layers = []
        for row, values in zip(self.table, host):
            entry: dict[str, Any] = {
                "layer": row.layer, "name": row.name, "load": values[:row.experts],
                "dropped": sum(values[width:width + row.experts]) if values[2 * width + 2] else None,
                "tokens": values[2 * width], "calls": values[2 * width + 1], "processes": values[2 * width + 3]}
            if row.ep_ranks:  # only the processes that hold its experts: another pipeline stage receives none
                entry["ep_ranks"] = list(row.ep_ranks)
                entry["ep_tokens"] = [values[2 * width + extra + r] for r in row.ep_ranks]
            layers.append(entry)
        self.reset()
        errors = [f"{name}: {error}" for name, error in self._errors.items()]
        self._errors = {}
        return Interval(layers, errors)

    def reset(self) -> None:
        """Forget the counts since the last interval (a resume starts its first interval afresh)."""
        for entry in self._local:
            if entry.chosen is not None:
                entry.chosen.zero_()
            if entry.dropped is not None:
                entry.dropped.zero_()
            entry.tokens = entry.calls = 0
