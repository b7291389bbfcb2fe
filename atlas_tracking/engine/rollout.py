"""Rollout agreement: the trainer's forward on the rollout's tokens, its routing read against the rollout
engine's (docs/rollout.md).

:func:`rollout_agreement` takes the routed experts a rollout engine returned for replay (vLLM's and SGLang's
``[seq, layers, k]`` arrays, batched as ``[batch, seq, layers, k]``), runs the model's own forward on the same
tokens as the model is (its dtype, its autocast, its device, its mode), reads every routed layer's routing from
its router with the adapters a gate uses, and compares the two per token position
(:mod:`atlas_tracking.receipts.rollout`). Nothing is counted by the between-gates telemetry (the forward runs
without gradients: it reads the model, it does not train it) and nothing is written: a plain loop hands the result to
:meth:`~atlas_tracking.gate.AtlasGate.rollout` to record it.

Example (a rollout engine that routes the same as the trainer, but for one planted swap):
    >>> import torch
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> _ = torch.manual_seed(0)
    >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ...     head_dim=8, num_experts=8, num_experts_per_tok=2)).eval()
    >>> ids = torch.randint(0, 64, (2, 8))
    >>> routes = trainer_routes(model, ids)                 # [2, 8, 2 layers, k = 2]: what the trainer chose
    >>> routes[1, 3, 0] = (routes[1, 3, 0] + 1) % 8         # the rollout chose otherwise at one position
    >>> result = rollout_agreement(model, ids, routes)
    >>> [(row["layer"], row["tokens"], row["mismatched"]) for row in result["layers"]]
    [(0, 16, 1), (1, 16, 0)]
    >>> result["first_mismatch"]["by_layer"], result["first_mismatch"]["none"]
    ({'0': 1, '1': 0}, 15)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.adapters.base import RoutedLayer
from atlas_tracking.engine.collectives import checkpoint
from atlas_tracking.engine.param_reference import collective_device
from atlas_tracking.receipts.rollout import (
    COUNTS,
    LOGPROB_COUNTS,
    TokenComparison,
    compare_tokens,
    first_mismatch,
    layer_counts,
    layer_row,
    logprob_counts,
    logprob_row,
    mismatch_gaps,
    within,
)

Forward = Callable[[nn.Module, torch.Tensor, torch.Tensor], Any]
"""``forward(model, input_ids, attention_mask)``: the model's forward on the batch; returns its output (logits,
or an object with ``.logits``, for the trainer's log-probabilities) or None."""

DOCS = "docs/rollout.md#the-rollouts-routed-experts"
"""Where the expected layout of the rollout's routed experts is explained (named in every input error)."""


class RolloutInputError(ValueError):
    """The rollout's routed experts (or the batch handed with them) do not fit the model."""


def default_forward(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
    """A transformers-style causal LM called with its attention mask (no cache); any other module on the ids."""
    if hasattr(model, "config") and hasattr(model, "get_input_embeddings"):
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return model(input_ids)


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.from_numpy(np.ascontiguousarray(value))
    except (TypeError, ValueError) as exc:
        raise RolloutInputError(f"{name} must be a torch tensor or a numpy array, got {type(value).__name__}") from exc


def _integer_routes(routed_experts: Any) -> torch.Tensor:
    routes = _as_tensor(routed_experts, "routed_experts")
    if routes.dtype.is_floating_point or routes.dtype.is_complex or routes.dtype == torch.bool:
        raise RolloutInputError(f"routed_experts must hold integer expert ids, got dtype {routes.dtype} ({DOCS})")
    if routes.dim() != 4:
        raise RolloutInputError(f"routed_experts must be [batch, seq, routed_layers, k], got shape "
                                f"{list(routes.shape)} ({DOCS})")
    return routes.to(torch.int64)


def decoder_layers(model: nn.Module, layers: list[RoutedLayer]) -> int:
    """The number of decoder layers of ``model`` (its text config's ``num_hidden_layers``; else one past its
    highest routed layer number): the layer axis of a rollout engine that returns every decoder layer."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    count = getattr(text, "num_hidden_layers", None)
    return int(count) if isinstance(count, int) else max(int(layer.index) for layer in layers) + 1


def _layer_rows(model: nn.Module, layers: list[RoutedLayer], width: int) -> tuple[str, list[int]]:
    """Which row of the layer axis holds each routed layer: ``routed`` (one row per routed layer, in forward
    order) or ``decoder`` (one row per decoder layer, dense ones included, as vLLM and SGLang return them)."""
    if width == len(layers):
        return "routed", list(range(len(layers)))
    decoder = decoder_layers(model, layers)
    numbers = [int(layer.index) for layer in layers]
    if width == decoder and len(set(numbers)) == len(numbers) and min(numbers) >= 0:
        return "decoder", numbers
    raise RolloutInputError(
        f"routed_experts has {width} layers; the model has {len(layers)} routed layers (layer numbers "
        f"{numbers}) in {decoder} decoder layers: give one row per routed layer, in forward order, or one per "
        f"decoder layer ({DOCS})")


def _check(routes: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, layers: list[RoutedLayer],
           rows: list[int]) -> None:
    """Shapes, k and expert ids; a clear error naming what differs."""
    if ids.dim() != 2:
        raise RolloutInputError(f"input_ids must be [batch, seq], got shape {list(ids.shape)}")
    if list(mask.shape) != list(ids.shape):
        raise RolloutInputError(f"attention_mask has shape {list(mask.shape)}, input_ids {list(ids.shape)}")
    if routes.shape[0] != ids.shape[0] or routes.shape[1] != ids.shape[1]:
        raise RolloutInputError(
            f"routed_experts covers [batch, seq] = {list(routes.shape[:2])}, input_ids {list(ids.shape)}: give "
            f"one row per token position (pad positions without a route with -1) ({DOCS})")
    for row, layer in zip(rows, layers):
        if int(layer.top_k) != routes.shape[3]:
            raise RolloutInputError(f"routed_experts has k = {routes.shape[3]}; routed layer {layer.index} "
                                    f"({layer.name}) selects k = {layer.top_k}")
        ids_of_layer = routes[:, :, row]
        bad = (ids_of_layer < -1) | (ids_of_layer >= int(layer.num_experts))
        if bool(bad.any()):
            b, s, j = (int(v) for v in bad.nonzero()[0])
            raise RolloutInputError(
                f"routed_experts[{b}, {s}, {row}, {j}] = {int(ids_of_layer[b, s, j])} is not an expert of routed "
                f"layer {layer.index} ({layer.name}: experts 0..{int(layer.num_experts) - 1}; -1 marks a position "
                f"without a route)")


def _router_rows(routes: torch.Tensor, layer: RoutedLayer) -> torch.Tensor:
    """``[batch, seq, k]`` routes in the order the layer's router sees the tokens (``[seq, batch]`` for a
    sequence-first layer), flattened to ``[N, k]``."""
    return (routes.transpose(0, 1) if layer.sequence_first else routes).reshape(-1, routes.shape[-1])


def _host_fields(parts: list[list[TokenComparison]], layers: list[RoutedLayer], batch: int,
                 seq: int) -> list[np.ndarray]:
    """Each :class:`TokenComparison` field as one ``[layers, ..., batch * seq]`` host array in batch-major order:
    the layers' router calls concatenated on the device, then one copy per field."""
    out = []
    for name in ("usable", "overlap", "margin_rel", "gap_rel", "near_tie"):
        per_layer = []
        for layer, calls in zip(layers, parts):
            values = torch.cat([getattr(call, name) for call in calls], dim=-1)
            if layer.sequence_first:
                lead = values.shape[:-1]
                values = values.reshape(*lead, seq, batch).transpose(-1, -2).reshape(*lead, -1)
            per_layer.append(values)
        out.append(torch.stack([v.to(per_layer[0].device) for v in per_layer]).cpu().numpy())
    return out


Read = Callable[[int, Any, int], Any]
"""``read(i, routing, start)``: what to keep of routed layer ``i``'s router call whose token rows start at
``start`` (in the router's order), given its :class:`~atlas_tracking.adapters.base.Routing`."""


class RouterReads:
    """Forward hooks on every routed layer's router that keep ``read(...)`` of each call, for one forward."""

    def __init__(self, layers: list[RoutedLayer], read: Read):
        self.layers, self.read = layers, read
        self.parts: list[list[Any]] = [[] for _ in layers]
        self.rows = [0] * len(layers)
        self.error: Exception | None = None

    def hook(self, i: int):
        def on_router(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self.error is not None:
                return
            try:
                g = (args or tuple(kwargs.values()))[0]
                g = g.reshape(-1, g.shape[-1])
                self.parts[i].append(self.read(i, self.layers[i].routing(output, g), self.rows[i]))
                self.rows[i] += len(g)
            except Exception as exc:  # raised after the forward, with the hooks removed
                self.error = exc
        return on_router

    def run(self, call: Callable[[], Any], tokens: int | None) -> Any:
        """``call()`` (the forward, or a whole ``generate``) with the hooks on, under ``no_grad`` (so uncounted) and
        inside every layer's :meth:`~atlas_tracking.adapters.base.RoutedLayer.gate_context` (a router that samples,
        such as DeepSpeed's second-expert sampling, routes deterministically, and the training run's random stream
        is left as it was); every routed layer must have routed ``tokens`` positions (None: any number)."""
        handles = [layer.router.register_forward_hook(self.hook(i), with_kwargs=True)
                   for i, layer in enumerate(self.layers)]
        try:
            with torch.no_grad(), contextlib.ExitStack() as contexts:
                for layer in self.layers:  # a router that samples reads as a gate reads it (and leaves no trace)
                    contexts.enter_context(layer.gate_context())
                output = call()
        finally:
            for handle in handles:
                handle.remove()
        if self.error is not None:
            raise self.error
        for layer, rows in zip(self.layers, self.rows):
            if tokens is not None and rows != tokens:
                raise RolloutInputError(f"routed layer {layer.index} ({layer.name}) routed {rows} token positions "
                                        f"in the forward; the batch holds {tokens}")
        return output


def _batch(model: nn.Module, input_ids: Any, attention_mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids and the mask (default: all ones) as int64 on the model's device."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = _as_tensor(input_ids, "input_ids").to(device=device, dtype=torch.int64)
    mask = (torch.ones_like(ids) if attention_mask is None
            else _as_tensor(attention_mask, "attention_mask").to(device=device, dtype=torch.int64))
    return ids, mask


def _trainer_logprobs(output: Any, ids: torch.Tensor) -> np.ndarray:
    """``[batch, seq]`` log-probabilities the forward's logits give each token (position 0: NaN), fp32."""
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if logits is None:
        raise RolloutInputError("rollout_logprobs were given but the forward returned no logits: pass "
                                "trainer_logprobs, or a forward that returns the logits")
    out = np.full(tuple(ids.shape), np.nan, dtype=np.float32)
    for b in range(ids.shape[0]):  # one sequence at a time: [seq, vocab] in fp32, never the whole batch
        lp = torch.log_softmax(logits[b, :-1].float(), dim=-1).gather(1, ids[b, 1:, None]).squeeze(1)
        out[b, 1:] = lp.cpu().numpy()
    return out


def _as_logprobs(value: Any, shape: tuple[int, int], name: str) -> np.ndarray:
    array = _as_tensor(value, name).detach().float().cpu().numpy()
    if array.shape != shape:
        raise RolloutInputError(f"{name} has shape {list(array.shape)}, input_ids {list(shape)}")
    return array


@dataclass
class Readout:
    """One forward's comparison, on the host, before it is summarised (:func:`summarize`)."""

    layers: list[RoutedLayer]
    axis: str
    """``routed`` or ``decoder``: the layer axis the rollout's array had."""
    fields: list[np.ndarray]
    """``usable``, ``overlap``, ``margin_rel``, ``gap_rel`` (each ``[routed layers, batch * seq]``) and ``near_tie``
    (``[routed layers, precisions, batch * seq]``), batch-major."""
    mask: np.ndarray
    """``[batch * seq]`` bool: the positions compared."""
    logprobs: tuple[np.ndarray, np.ndarray] | None = None
    """The rollout's and the trainer's ``[batch * seq]`` log-probabilities, when the rollout's were given."""


def read_agreement(model: nn.Module, input_ids: Any, routed_experts: Any, attention_mask: Any = None, *,
                   rollout_logprobs: Any = None, trainer_logprobs: Any = None, forward: Forward | None = None,
                   layers: list[RoutedLayer] | None = None) -> Readout:
    """The model's forward on ``input_ids`` with its routing compared to ``routed_experts`` per token position
    (the arguments of :func:`rollout_agreement`); nothing summarised yet."""
    layers = layers if layers is not None else find_routed_layers(model)
    routes = _integer_routes(routed_experts)
    axis, rows = _layer_rows(model, layers, routes.shape[2])
    ids, mask = _batch(model, input_ids, attention_mask)
    _check(routes, ids, mask, layers, rows)
    batch, seq = ids.shape
    theirs = [_router_rows(routes[:, :, row], layer) for row, layer in zip(rows, layers)]

    def compare(i: int, routing: Any, start: int) -> TokenComparison:
        given = theirs[i][start:start + len(routing.active)].to(routing.active.device)
        if len(given) != len(routing.active):
            raise RolloutInputError(f"routed layer {layers[i].index} ({layers[i].name}) routed more token "
                                    f"positions than the batch holds ({batch * seq})")
        return compare_tokens(routing.scores.float(), routing.active, given)

    reads = RouterReads(layers, compare)
    output = reads.run(lambda: (forward or default_forward)(model, ids, mask), batch * seq)
    readout = Readout(layers, axis, _host_fields(reads.parts, layers, batch, seq),
                      mask.bool().cpu().numpy().reshape(-1))
    if rollout_logprobs is not None:
        shape = (batch, seq)
        ours = (_as_logprobs(trainer_logprobs, shape, "trainer_logprobs") if trainer_logprobs is not None
                else _trainer_logprobs(output, ids))
        readout.logprobs = (_as_logprobs(rollout_logprobs, shape, "rollout_logprobs").reshape(-1), ours.reshape(-1))
    return readout


def _all_processes() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


def _summed(values: list[float], across: bool) -> list[float]:
    """``values`` summed over every process when ``across`` (float64, one ``all_reduce``)."""
    if not (across and _all_processes()):
        return values
    vector = torch.tensor(values, dtype=torch.float64, device=collective_device())
    checkpoint("the rollout sums")
    torch.distributed.all_reduce(vector)
    return vector.cpu().tolist()


def _gathered(gaps: list[np.ndarray], across: bool) -> list[np.ndarray]:
    """Every process's mismatched-position gaps, per layer, when ``across`` (one ``all_gather_object``)."""
    if not (across and _all_processes()):
        return gaps
    every: list[Any] = [None] * torch.distributed.get_world_size()
    checkpoint("the rollout gaps")
    torch.distributed.all_gather_object(every, [g.tolist() for g in gaps])
    return [np.asarray([v for part in every for v in part[i]], dtype=np.float64) for i in range(len(gaps))]


def summarize(readout: Readout, replayed: bool = False, across_processes: bool = True) -> dict[str, Any]:
    """The result :func:`rollout_agreement` returns; with ``across_processes``, summed over every process of the
    default process group when one is initialised (collective: every process calls it, each with its own batch):
    counts are summed, the perturbation's quantiles are those of every process's mismatched positions together
    and the boundary mass is counted at their median (three collectives)."""
    layers, mask = readout.layers, readout.mask
    ks = [int(layer.top_k) for layer in layers]
    counts = [layer_counts(*(readout.fields[j][i] for j in (0, 1, 2, 4)), mask=mask, k=k) for i, k in enumerate(ks)]
    mismatch = readout.fields[1] != np.array(ks)[:, None]
    first = first_mismatch(mismatch, readout.fields[0], mask, [int(layer.index) for layer in layers])
    lp = logprob_counts(*readout.logprobs, mask) if readout.logprobs is not None else None
    flat = [c[name] for c in counts for name in COUNTS] + [first["tokens"], first["none"], *first["by_layer"].values()]
    flat += [lp[name] for name in LOGPROB_COUNTS] if lp is not None else []
    flat = _summed(flat, across_processes)
    width = len(COUNTS)
    counts = [dict(zip(COUNTS, flat[i * width:(i + 1) * width])) for i in range(len(layers))]
    rest = flat[len(layers) * width:]
    first = {"tokens": int(rest[0]), "by_layer": {key: int(v) for key, v in zip(first["by_layer"], rest[2:])},
             "none": int(rest[1])}
    gaps = _gathered([mismatch_gaps(*(readout.fields[j][i] for j in (0, 1, 3)), mask=mask, k=k)
                      for i, k in enumerate(ks)], across_processes)
    medians = [float(np.median(g)) if g.size else float("nan") for g in gaps]
    boundary = _summed([within(readout.fields[0][i], readout.fields[2][i], mask, m) if g.size else 0
                        for i, (g, m) in enumerate(zip(gaps, medians))], across_processes)
    result: dict[str, Any] = {
        "tokens": first["tokens"], "layer_axis": readout.axis, "replayed": bool(replayed),
        "layers": [{"layer": int(layer.index), "name": layer.name,
                    **layer_row(c, g, k, int(b) if g.size else None)}
                   for layer, c, g, k, b in zip(layers, counts, gaps, ks, boundary)],
        "first_mismatch": first,
    }
    if lp is not None:
        result["logprobs"] = logprob_row(dict(zip(LOGPROB_COUNTS, rest[2 + len(layers):])))
    return result


def rollout_agreement(model: nn.Module, input_ids: Any, routed_experts: Any, attention_mask: Any = None, *,
                      rollout_logprobs: Any = None, trainer_logprobs: Any = None, replayed: bool = False,
                      forward: Forward | None = None, layers: list[RoutedLayer] | None = None) -> dict[str, Any]:
    """The trainer's routing of ``input_ids`` against the rollout's ``routed_experts`` (docs/rollout.md), for this
    process's batch.

    Args:
        model: the model as the trainer holds it (dtype, device, mode: its routing is what the update uses).
        input_ids: ``[batch, seq]`` token ids (prompt and completion, as the rollout engine saw them).
        routed_experts: ``[batch, seq, layers, k]`` integer expert ids (numpy or torch; any integer dtype),
            ``layers`` either the model's routed layers in forward order or every decoder layer (vLLM's and
            SGLang's layout, dense layers' rows ignored); ``-1`` marks a position without a route.
        attention_mask: ``[batch, seq]``, 1 where a position is compared (default: every position).
        rollout_logprobs: ``[batch, seq]`` the rollout engine's log-probability of each token given the ones
            before it (NaN where it has none, e.g. prompt tokens).
        trainer_logprobs: the trainer's, the same way; default: from the forward's logits.
        replayed: the update replayed the rollout's routes (the record says so; ``fallback`` counts the
            positions whose replay could not apply).
        forward: how the model is called (default :func:`default_forward`).
        layers: the model's routed layers (default: :func:`~atlas_tracking.adapters.find_routed_layers`).

    Returns:
        ``layers`` (one entry per routed layer: :func:`~atlas_tracking.receipts.rollout.layer_agreement` with
        ``layer``, the model's own layer number, and ``name``), ``first_mismatch``, ``tokens``, ``layer_axis``
        (``routed`` or ``decoder``), ``replayed`` and, with ``rollout_logprobs``, ``logprobs``.
    """
    readout = read_agreement(model, input_ids, routed_experts, attention_mask, rollout_logprobs=rollout_logprobs,
                             trainer_logprobs=trainer_logprobs, forward=forward, layers=layers)
    return summarize(readout, replayed, across_processes=False)


def trainer_routes(model: nn.Module, input_ids: Any, attention_mask: Any = None, *,
                   forward: Forward | None = None, layers: list[RoutedLayer] | None = None) -> torch.Tensor:
    """``[batch, seq, routed_layers, k]`` int64: the active sets the model's own routers choose for ``input_ids``
    (read with the same hooks), in the layout :func:`rollout_agreement` reads: a rollout engine's routes to
    replay, or a trainer's to hand another engine."""
    layers = layers if layers is not None else find_routed_layers(model)
    ids, mask = _batch(model, input_ids, attention_mask)
    batch, seq = ids.shape
    reads = RouterReads(layers, lambda i, routing, start: routing.active.cpu())
    reads.run(lambda: (forward or default_forward)(model, ids, mask), batch * seq)
    out = []
    for layer, parts in zip(layers, reads.parts):
        active = torch.cat(parts)
        out.append(active.view(seq, batch, -1).transpose(0, 1) if layer.sequence_first else active.view(batch, seq, -1))
    return torch.stack(out, dim=2)
