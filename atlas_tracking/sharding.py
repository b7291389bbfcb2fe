"""Sharded parameters during a gate: gathered while the hooks read them, sharded again afterwards.

Inside a model's own forward, ZeRO-3 and FSDP gather the parameters of the module that runs. The
capture also reads a layer's norm and router outside their own forward (re-routing anchors and the
post-update state): :func:`gathered` gathers the ZeRO-3 partitions of those parameters for the
duration and partitions them again on exit (``deepspeed.zero.GatheredParameters``, read-only).
After the gate, :func:`reshard` returns FSDP2 modules that the forward left unsharded (FSDP2
keeps the root's parameters after a forward, expecting a backward) to their sharded state.

Example (nothing sharded: both are no-ops):
    >>> import torch
    >>> norm = torch.nn.RMSNorm(4)
    >>> with gathered([norm]):
    ...     float(norm.weight.detach().sum())
    4.0
    >>> reshard(norm)
    0
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
    from atlas_tracking.integrations.deepspeed import zero3_gathered

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
