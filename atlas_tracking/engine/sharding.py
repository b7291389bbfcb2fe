"""Sharded parameters during a gate: gathered while the hooks read them, sharded again afterwards.

Inside a model's own forward, ZeRO-3 and FSDP hold the parameters of the module that runs; the
field evaluation runs there (inside the experts' forward, or in the MoE block's forward hook). The
hooks also read the layer's norm and router outside their own forward (re-routing anchors and the
post-update state): under DeepSpeed 0.19 ZeRO-3 (tested with every parameter partitioned) those are
still held in the block's hook, and :func:`gathered` guards the reads for configurations that release
them earlier (``deepspeed.zero.GatheredParameters`` on the partitions, read-only, re-partitioned on
exit). After the gate, :func:`reshard` returns FSDP2 modules that the forward left unsharded (FSDP2
keeps the root's parameters after a forward, expecting a backward) to their sharded state.
:func:`model_class_name` names a model by its own class, not by the subclass ``fully_shard`` makes.

Example (nothing sharded: both are no-ops):
    >>> import torch
    >>> norm = torch.nn.RMSNorm(4)
    >>> with gathered([norm]):
    ...     float(norm.weight.detach().sum())
    4.0
    >>> reshard(norm), model_class_name(norm)
    (0, 'RMSNorm')
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from torch import nn


def gathered(modules: Iterable[nn.Module]) -> contextlib.AbstractContextManager:
    """Gather the ZeRO-3-partitioned parameters of ``modules`` inside the block (a no-op for any other)."""
    partitioned = [p for m in modules for p in m.parameters()
                   if getattr(getattr(p, "ds_status", None), "name", None) == "NOT_AVAILABLE"]
    if not partitioned:
        return contextlib.nullcontext()

    return zero3_gathered(partitioned)


def reshard(model: nn.Module) -> int:
    """Reshard every FSDP2 module of ``model`` (``FSDPModule.reshard``, local); returns how many there are."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return 0
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.reshard()
    return len(modules)


def model_class_name(model: nn.Module) -> str:
    """The model's class name; for an FSDP2 module, its own class rather than ``fully_shard``'s ``FSDP<Name>``
    subclass, so a baseline taken unsharded matches the sharded model."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return type(model).__name__
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule)).__name__


def zero3_gathered(params: list[nn.Parameter]) -> contextlib.AbstractContextManager:
    """ZeRO-3 partitioned ``params`` gathered inside the block and partitioned again on exit (read-only)."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
