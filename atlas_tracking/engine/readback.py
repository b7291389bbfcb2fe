"""A gate's results brought to the host in one transfer per device (docs/receipts.md#host-synchronisations).

A gate keeps every per-window sum, count and per-layer array on the model's device until the canary has been run.
Each copy to the host waits for the device to finish its queue (a host synchronisation); copied one by one, the
arrays of a gate made some twenty such waits per routed layer. :func:`read_back` packs every tensor of a nested
structure into one byte buffer per device, copies each buffer once and hands back host tensors of the same dtypes
and shapes in the same structure, each holding its own memory (a view of the buffer would carry all of it
wherever it is pickled, to the other ranks of a distributed gate above all).

Example:
    >>> import torch
    >>> tree = {"sums": torch.tensor([1.5, 2.0]), "parts": [torch.tensor([[1, 2]]), None], "flag": torch.tensor(True)}
    >>> host = read_back(tree)
    >>> host["sums"].tolist(), host["parts"][0].tolist(), host["parts"][1], bool(host["flag"])
    ([1.5, 2.0], [[1, 2]], None, True)
"""

from __future__ import annotations

from typing import Any

import torch

_ALIGN = 16
"""Bytes each tensor's place in the buffer is aligned to (any dtype's element size divides it)."""


def _leaves(tree: Any, out: list[torch.Tensor]) -> None:
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, dict):
        for value in tree.values():
            _leaves(value, out)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            _leaves(value, out)


def _rebuild(tree: Any, host: dict[int, torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        return host[id(tree)]
    if isinstance(tree, dict):
        return {key: _rebuild(value, host) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_rebuild(value, host) for value in tree)
    return tree


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` as a flat uint8 tensor on its device (booleans as one byte each)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)


def read_back(tree: Any) -> Any:
    """``tree`` (dicts, lists and tuples of tensors and other values) with every tensor on the host, copied in one
    transfer per device; each host tensor holds its own memory."""
    leaves: list[torch.Tensor] = []
    _leaves(tree, leaves)
    host: dict[int, torch.Tensor] = {}
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in leaves:
        if id(t) not in host:
            host[id(t)] = t
            by_device.setdefault(t.device, []).append(t)
    for device, tensors in by_device.items():
        parts, places = [], []
        offset = 0
        for t in tensors:
            raw = _as_bytes(t)
            pad = -raw.numel() % _ALIGN
            parts.extend([raw, torch.zeros(pad, dtype=torch.uint8, device=device)] if pad else [raw])
            places.append(offset)
            offset += raw.numel() + pad
        buffer = torch.cat(parts).cpu() if parts else torch.zeros(0, dtype=torch.uint8)
        for t, start in zip(tensors, places):
            size = t.numel() * t.element_size()
            raw = buffer[start : start + size]
            host[id(t)] = (raw.to(torch.bool) if t.dtype == torch.bool else raw.view(t.dtype).clone()).view(t.shape)
    return _rebuild(tree, host)
