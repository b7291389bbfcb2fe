"""A planted routing collapse between gates, and the tests' own route counts to hold the telemetry to.

:func:`plant_collapse` sets one DeepSeek-V3-style router's selection-bias rows so that every token of that layer
routes to the same experts (a correction bias gone wrong: the aux-loss-free balancing of DeepSeek-V3 keeps such a
bias, and no gradient moves it back). :class:`OwnCounts` counts, with its own forward hooks and plain Python loops
over the routers' top-k index, the routes each training forward chose, per optimizer step: what ``load.jsonl``
must hold, computed without the code under test.

Example:
    >>> from atlas_tracking.testing.families import family_model
    >>> from atlas_tracking.adapters import find_routed_layers
    >>> model = family_model("deepseek_v3")
    >>> layer = find_routed_layers(model)[0]
    >>> plant_collapse(layer, (0, 1))
    >>> import torch
    >>> sorted(set(layer.route_active(torch.randn(50, 32)).flatten().tolist()))
    [0, 1]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from atlas_tracking.adapters.base import RoutedLayer


def plant_collapse(layer: RoutedLayer, experts: tuple[int, ...] = (0, 1), bias: float = 10.0) -> None:
    """Make ``layer`` route every token to ``experts``: their rows of the router's selection bias
    (``e_score_correction_bias``) set to ``bias`` and every other row to 0 (the sigmoid scores stay below 1)."""
    with torch.no_grad():
        rows = layer.router.e_score_correction_bias
        rows.zero_()
        rows[list(experts)] = bias


class OwnCounts:
    """Routes per layer and expert of every training forward, counted by the test's own hooks on each router's
    top-k index (``router_output[2]``: the transformers router contract), per optimizer step.

    Call :meth:`end_step` after each optimizer step with its number; :meth:`between` sums the steps of an
    interval. A training forward is one in training mode, with gradients on and outside a backward pass; with
    ``reentrant`` (the model's checkpointed layers run their forward with gradients off, inside torch's reentrant
    checkpoint) gradients may be off, and the test keeps its no-gradient passes out with :meth:`skipping`."""

    def __init__(self, layers: list[RoutedLayer], reentrant: bool = False):
        self.reentrant = reentrant
        self.skipped = False
        self.layers = {layer.index: layer.num_experts for layer in layers}
        self.current: dict[int, list[int]] = {i: [0] * n for i, n in self.layers.items()}
        self.tokens: dict[int, int] = dict.fromkeys(self.layers, 0)
        self.steps: dict[int, tuple[dict[int, list[int]], dict[int, int]]] = {}
        self.handles = [layer.router.register_forward_hook(self._hook(layer.index)) for layer in layers]

    def _hook(self, index: int):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if (not module.training or torch._C._current_graph_task_id() != -1  # a training forward, not a recompute
                    or self.skipped or not (torch.is_grad_enabled() or self.reentrant)):
                return
            for row in output[2].reshape(-1, output[2].shape[-1]).tolist():
                for expert in row:
                    self.current[index][expert] += 1
                self.tokens[index] += 1
        return hook

    @contextlib.contextmanager
    def skipping(self) -> Iterator[None]:
        """The test's forwards inside the block are not training forwards."""
        self.skipped = True
        try:
            yield
        finally:
            self.skipped = False

    def end_step(self, step: int) -> None:
        self.steps[int(step)] = (self.current, self.tokens)
        self.current = {i: [0] * n for i, n in self.layers.items()}
        self.tokens = dict.fromkeys(self.layers, 0)

    def between(self, first: int, last: int) -> tuple[dict[int, list[int]], dict[int, int]]:
        """Per layer, the routes per expert and the tokens of steps ``first..last``."""
        load = {i: [0] * n for i, n in self.layers.items()}
        tokens = dict.fromkeys(self.layers, 0)
        for step in range(first, last + 1):
            counts, seen = self.steps.get(step, ({}, {}))
            for i, row in counts.items():
                load[i] = [a + b for a, b in zip(load[i], row)]
                tokens[i] += seen[i]
        return load, tokens

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
