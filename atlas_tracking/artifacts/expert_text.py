"""A record's per-expert picture in words: each routed layer as the model numbers it, and which experts of each
layer are dead or overloaded (docs/receipts.md#per-expert-load), as the report and every alert channel say it.

Example:
    >>> layers = [{"name": "model.layers.2.mlp", "index": 2, "expert_load": [0, 9, 0, 1, 0, 0, 0, 6]}]
    >>> expert_lines(layers)
    ['layer 2: experts 0, 2, 4 (+2 more) dead; experts 1, 7 overloaded.']
"""

from __future__ import annotations

from typing import Any

from atlas_tracking.adapters.base import _layer_index
from atlas_tracking.receipts.experts import OVERLOAD_FACTOR, bounded_list, dead_experts, overloaded_experts

MAX_LAYERS = 4
"""Layers :func:`expert_lines` names before it counts the rest."""


def layer_label(layer: dict[str, Any]) -> str:
    """A routed layer as the model numbers it: the record's decoder-layer ``index``, else the index read from its
    name, else its ordinal among the routed layers.

    >>> layer_label({"name": "model.layers.12.mlp", "index": 12}), layer_label({"name": "model.layers.7.mlp"})
    ('layer 12', 'layer 7')
    >>> layer_label({"name": "moe", "index": -1, "ordinal": 2})
    'routed #2'
    """
    index = layer.get("index")
    if index is None or index < 0:
        index = _layer_index(str(layer.get("name", "")))
    return f"layer {index}" if index >= 0 else f"routed #{layer.get('ordinal', '?')}"


def expert_lines(layers: list[dict[str, Any]], max_layers: int = MAX_LAYERS) -> list[str]:
    """One line per routed layer with dead or overloaded experts (share over ``OVERLOAD_FACTOR`` x 1/E), each a
    bounded list plus a count; at most ``max_layers`` lines, then one that counts the layers left out.

    >>> expert_lines([{"index": i, "expert_load": [0, 4, 4, 4]} for i in range(6)], max_layers=2)
    ['layer 0: expert 0 dead.', 'layer 1: expert 0 dead.', '(+4 more layers with dead or overloaded experts)']
    """
    lines = []
    for layer in layers:
        loads = layer.get("expert_load")
        if not loads:
            continue
        parts = []
        dead, over = dead_experts(loads), overloaded_experts(loads, OVERLOAD_FACTOR)
        for ids, what in ((dead, "dead"), (over, "overloaded")):
            if ids:
                parts.append(f"expert{'s' if len(ids) > 1 else ''} {bounded_list(ids)} {what}")
        if parts:
            lines.append(f"{layer_label(layer)}: {'; '.join(parts)}.")
    if len(lines) > max_layers:
        lines = [*lines[:max_layers], f"(+{len(lines) - max_layers} more layers with dead or overloaded experts)"]
    return lines
