"""Count the points where code run on a tensor's device waits for it on the host, on any device.

On an accelerator such a read is a host synchronisation (the host waits for the device's queue to drain); on the
CPU nothing waits, so ``torch.cuda.set_sync_debug_mode`` has nothing to report there. :func:`host_reads` counts the
same points on every device, so a test on the CPU holds a gate to the synchronisations it would make on a GPU:

- the operators whose result size or value the host needs (``aten._local_scalar_dense``, from ``.item()``,
  ``bool()``, ``int()`` and ``float()`` of a tensor; ``nonzero``; ``masked_select``; ``unique``; ``equal``; indexing by a
  boolean mask; ``repeat_interleave`` without an output size; ``bincount`` without a length);
- a tensor copied to the host (``.cpu()``, also of a CPU tensor: on an accelerator it would be a copy, ``.to`` the
  CPU from another device) or read out as Python values (``.tolist()``), unless it is (a view of) a host copy made
  inside the count.

``.numpy()`` is not counted: on an accelerator it needs the host copy first, which is. Each read is counted once, at
the outermost of these points (``.tolist()`` is not also an ``.item()`` per element), with the source line outside
``torch`` that made it.

Example:
    >>> import torch
    >>> t = torch.arange(4)
    >>> with host_reads() as reads:
    ...     _ = (t * 2).sum()        # stays on the device: no read
    ...     _ = int(t.max())         # the value on the host
    ...     _ = t.cpu().numpy()      # one copy to the host, read out
    >>> reads.total
    2
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SYNCING_OPS = {
    "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2",
    "aten::unique_dim", "aten::unique_consecutive", "aten::equal",
}
"""Operators whose result the host needs before it can go on."""
_TORCH = str(Path(torch.__file__).parent)
_HERE = __file__


@dataclass
class HostReads:
    """Host reads counted inside :func:`host_reads`: ``where`` maps ``file:line`` to its reads."""

    where: collections.Counter = field(default_factory=collections.Counter)

    @property
    def total(self) -> int:
        return sum(self.where.values())

    def add(self) -> None:
        self.where[_caller()] += 1


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH) or frame.f_code.co_filename == _HERE):
        frame = frame.f_back
    return "?" if frame is None else f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


def _syncs(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    name = func._schema.name
    if name in _SYNCING_OPS:
        return True
    if name == "aten::index" and len(args) > 1:  # a boolean mask: the result's size is the mask's count
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
    if name == "aten::repeat_interleave":
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    if name == "aten::bincount":
        return True
    if name in ("aten::_to_copy", "aten::copy_"):
        src = args[1] if name == "aten::copy_" else args[0]
        dst = args[0].device if name == "aten::copy_" else kwargs.get("device")
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst is not None and \
            torch.device(dst).type == "cpu"
    return False


class _Mode(TorchDispatchMode):
    def __init__(self, reads: HostReads, state: threading.local):
        super().__init__()
        self.reads, self.state = reads, state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not getattr(self.state, "inside", False) and _syncs(func, args, kwargs):
            self.reads.add()
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_reads() -> Iterator[HostReads]:
    """Count the host reads of the code run inside (see the module's docstring)."""
    reads, state = HostReads(), threading.local()
    copies: set[int] = set()  # storages of the host copies made so far: reading them again waits for nothing
    held: list[torch.Tensor] = []  # and the copies themselves, so that no later tensor reuses their memory
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu")}

    def reading(name: str):
        original = originals[name]

        def read(self, *args, **kwargs):
            if getattr(state, "inside", False) or self.untyped_storage().data_ptr() in copies:
                return original(self, *args, **kwargs)
            reads.add()
            state.inside = True
            try:
                out = original(self, *args, **kwargs)
            finally:
                state.inside = False
            if name == "cpu":
                copies.add(out.untyped_storage().data_ptr())
                held.append(out)
            return out
        return read

    for name in originals:
        setattr(torch.Tensor, name, reading(name))
    try:
        with _Mode(reads, state):
            yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
