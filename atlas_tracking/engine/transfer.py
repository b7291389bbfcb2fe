"""A gate's transfers between the host and the model's device, one per direction and purpose
(docs/receipts.md#host-synchronisations).

A gate keeps every per-window sum, count and per-layer array on the model's device until the canary has been run.
Each copy to the host waits for the device to finish its queue (a host synchronisation); copied one by one, the
arrays of a gate made some twenty such waits per routed layer. :func:`read_back` packs every tensor of a nested
structure into one byte buffer per device (up to :data:`TRANSFER_BYTES` a buffer), copies each buffer once and hands back host tensors of the same dtypes
and shapes in the same structure, each holding its own memory (a view of the buffer would carry all of it wherever
it is pickled, to the other ranks of a distributed gate above all). :func:`send` is the other direction: host
tensors (a baseline's rows of a micro-batch) to the device in one copy from pinned memory that does not wait.

Example:
    >>> import torch
    >>> tree = {"sums": torch.tensor([1.5, 2.0]), "parts": [torch.tensor([[1, 2]]), None], "flag": torch.tensor(True)}
    >>> host = read_back(tree)
    >>> host["sums"].tolist(), host["parts"][0].tolist(), host["parts"][1], bool(host["flag"])
    ([1.5, 2.0], [[1, 2]], None, True)
    >>> send(tree, "cpu") is tree  # already there
    True
"""

from __future__ import annotations

from typing import Any

import torch

_ALIGN = 16
"""Bytes each tensor's place in a buffer is aligned to (any dtype's element size divides it)."""


def _leaves(tree: Any, out: list[torch.Tensor]) -> None:
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, dict):
        for value in tree.values():
            _leaves(value, out)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            _leaves(value, out)


def _rebuild(tree: Any, moved: dict[int, torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        return moved[id(tree)]
    if isinstance(tree, dict):
        return {key: _rebuild(value, moved) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_rebuild(value, moved) for value in tree)
    return tree


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` as a flat uint8 tensor on its device (booleans as one byte each)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)


def places(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Where each of ``tensors`` starts in a packed byte buffer, and the buffer's size (each place aligned).

    >>> places([torch.zeros(3), torch.zeros(1, dtype=torch.int64)])
    ([0, 16], 32)
    """
    starts, offset = [], 0
    for t in tensors:
        starts.append(offset)
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return starts, offset


def pack(tensors: list[torch.Tensor], into: torch.Tensor) -> None:
    """Copy the bytes of ``tensors`` into the uint8 buffer ``into`` at their :func:`places`."""
    for t, start in zip(tensors, places(tensors)[0]):
        raw = _as_bytes(t)
        into[start : start + raw.numel()].copy_(raw)


def unpack(buffer: torch.Tensor, like: list[torch.Tensor], copy: bool) -> list[torch.Tensor]:
    """The tensors of ``like``'s dtypes and shapes packed in ``buffer``: views of it, or copies (``copy``)."""
    out = []
    for t, start in zip(like, places(like)[0]):
        raw = buffer[start : start + t.numel() * t.element_size()]
        view = raw.view(t.dtype) if t.dtype != torch.bool else raw.view(torch.bool)
        out.append((view.clone() if copy else view).view(t.shape))
    return out


def _unique(tree: Any) -> list[torch.Tensor]:
    leaves: list[torch.Tensor] = []
    _leaves(tree, leaves)
    return list({id(t): t for t in leaves}.values())


TRANSFER_BYTES = 1 << 28
"""The most bytes :func:`read_back` packs into one transfer (256 MiB): the packed buffer is a second copy of what it
holds, on the device and on the host, so a frontier layout's results (at DeepSeek-V3 about 2 GB by their shapes, the coupling's
per-expert sums most of it) come in a few transfers, not one buffer of all of them."""


def groups(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """``tensors`` in order, in consecutive groups of at most ``limit`` packed bytes (a larger tensor alone).

    >>> [len(g) for g in groups([torch.zeros(4), torch.zeros(4), torch.zeros(64)], limit=32)]
    [2, 1]
    """
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        n = places([t])[1]
        if not out or size + n > limit:
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return out


def read_back(tree: Any, limit: int = TRANSFER_BYTES) -> Any:
    """``tree`` (dicts, lists and tuples of tensors and other values) with every tensor on the host, copied in one
    transfer per device and ``limit`` bytes (:data:`TRANSFER_BYTES`); each host tensor holds its own memory."""
    moved: dict[int, torch.Tensor] = {}
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in _unique(tree):
        by_device.setdefault(t.device, []).append(t)
    for device, tensors in by_device.items():
        for group in groups(tensors, limit):
            buffer = torch.empty(places(group)[1], dtype=torch.uint8, device=device)
            pack(group, buffer)
            moved.update(zip(map(id, group), unpack(buffer.cpu(), group, copy=True)))
    return _rebuild(tree, moved)


def send(tree: Any, device: torch.device | str) -> Any:
    """``tree``'s host tensors on ``device``, in one copy (on CUDA from pinned memory, which the host does not wait
    for; views of one device buffer); unchanged where ``device`` is the CPU."""
    device = torch.device(device)
    tensors = _unique(tree)
    if device.type == "cpu" or not tensors:
        return tree
    pinned = device.type == "cuda"  # elsewhere one ordinary copy
    staging = torch.empty(places(tensors)[1], dtype=torch.uint8, pin_memory=pinned)
    pack(tensors, staging)
    moved = unpack(staging.to(device, non_blocking=pinned), tensors, copy=False)
    return _rebuild(tree, dict(zip(map(id, tensors), moved)))
