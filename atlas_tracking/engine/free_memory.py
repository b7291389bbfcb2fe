"""How many field rows a gate's chunked calls of the experts may hold, from the memory free when the gate starts
(docs/receipts.md#memory).

A chunked call of the experts (the competitors', in fused mode; every field, unfused) holds, per (token, expert) row,
the row and its field in the model's dtype, and the receipts' arithmetic a few fp32 copies of it. The chunk is
already bounded by half the forward's own rows of a micro-batch; :func:`field_rows` also keeps it within
:data:`FREE_SHARE` of the memory free on the device when the gate starts (on the CPU, the memory the kernel reports
available), so that a large micro-batch on a nearly full accelerator is evaluated in more, smaller calls instead
of failing.

Example:
    >>> field_rows(free=1 << 30, width=1024, itemsize=2)  # a quarter of 1 GiB at 16 bytes per element of a row
    16384
    >>> field_rows(free=None, width=1024, itemsize=2) is None
    True
"""

from __future__ import annotations

import torch

FREE_SHARE = 0.25
"""The share of the free memory a chunked call's rows may take."""
ROW_COPIES_FP32 = 3
"""fp32 copies of a row the receipts' arithmetic holds at once (the field, its tangent part, a product)."""


def free_bytes(device: torch.device) -> int | None:
    """Bytes free for tensors on ``device`` now: on CUDA the driver's free memory plus what the caching allocator
    holds unused; on the CPU the kernel's available memory; None where it cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type == "cpu":
        return _available_host_bytes()
    return None


def _available_host_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (Linux), or None."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def field_rows(free: int | None, width: int, itemsize: int) -> int | None:
    """Rows of width ``width`` a chunked call may hold within :data:`FREE_SHARE` of ``free`` bytes (at least one;
    None: no bound), each row taking its input and field in the model's dtype (``itemsize`` bytes an element) and
    :data:`ROW_COPIES_FP32` fp32 copies."""
    if free is None:
        return None
    per_row = width * (2 * itemsize + 4 * ROW_COPIES_FP32)
    return max(1, int(free * FREE_SHARE) // per_row)
