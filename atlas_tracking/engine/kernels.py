"""Which path a gate's per-token field arithmetic takes: eager or compiled (``receipts.kernels``;
docs/receipts.md#field-kernels).

Each chunk of a routed layer's fields is reduced by one function, ``receipts/field_chunk.chunk_receipts``. Eager,
it is a few dozen small operations over ``[tokens, k, d]`` fields; compiled (``torch.compile(dynamic=True,
fullgraph=True)``, once per process, for every shape), they are fused, the fields' cast to fp32 included. A whole
graph or none: where the compiler would break the function into parts or, past its recompile limit, run it
uncompiled, it raises instead, so a chunk the record calls compiled was compiled. ``"auto"`` compiles on a CUDA
device where triton is importable and stays eager elsewhere: on a CPU a compile costs seconds in every process and
needs a C++ compiler. A compile, or a compiled call, that raises is never a gate's failure: the chunk is computed
eagerly, and so is every later chunk of the process; the reason is kept (:attr:`ChunkKernels.fallback`) and the
gate's record names it in each layer's self-check.

Example:
    >>> kernels = ChunkKernels()
    >>> kernels.path("eager", torch.device("cpu")), kernels.path("auto", torch.device("cpu"))
    ('eager', 'eager')
    >>> kernels.path("compiled", torch.device("cpu"))
    'compiled'
    >>> kernels.fallback = "RuntimeError: no C++ compiler"
    >>> kernels.path("compiled", torch.device("cpu"))
    'eager'
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch

from atlas_tracking.receipts.field_chunk import ChunkReceipts, chunk_receipts

log = logging.getLogger("atlas_tracking")

KERNEL_PATHS = ("eager", "compiled")
"""The paths a chunk can take, by their code in a layer's per-window ``kernels`` array."""
REASON_CHARS = 200
"""The most characters of a compile failure the record keeps."""


@functools.cache
def has_triton() -> bool:
    """Whether triton, which compiles for CUDA devices, can be imported (looked up once per process)."""
    return importlib.util.find_spec("triton") is not None


def failure_reason(exc: BaseException) -> str:
    """``Type: first line of the message`` of ``exc``, at most ``REASON_CHARS`` characters.

    >>> failure_reason(RuntimeError("no compiler\\nmore"))
    'RuntimeError: no compiler'
    """
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:REASON_CHARS]


class ChunkKernels:
    """The chunk arithmetic of one process: eager, or compiled at its first use and kept for every later one."""

    def __init__(self) -> None:
        self.compiled: Callable[..., ChunkReceipts] | None = None
        """The compiled :func:`chunk_receipts` (None until a chunk first takes the compiled path)."""
        self.fallback: str | None = None
        """Why this process computes eagerly although compiled was asked for (the error of the compile or compiled
        call that raised, cut to ``REASON_CHARS``); None while no compile failed."""

    def path(self, setting: str, device: torch.device) -> str:
        """The path a chunk on ``device`` takes under ``setting`` (``receipts.kernels``: auto, compiled or eager)."""
        if setting == "eager" or self.fallback is not None:
            return "eager"
        if setting == "compiled" or (device.type == "cuda" and has_triton()):
            return "compiled"
        return "eager"

    def __call__(self, setting: str, *args: Any, **kwargs: Any) -> tuple[ChunkReceipts, str]:
        """:func:`chunk_receipts` of ``args`` by the path ``setting`` chooses for their device, and that path
        (``"eager"`` where a compiled call raised: this process stays eager from then on)."""
        if self.path(setting, args[0].device) == "compiled":
            try:
                if self.compiled is None:
                    self.compiled = torch.compile(chunk_receipts, dynamic=True, fullgraph=True)
                return self.compiled(*args, **kwargs), "compiled"
            except Exception as exc:  # a compile failure never fails the gate
                self.fallback = failure_reason(exc)
                log.warning("receipts.kernels: the compiled field arithmetic failed (%s); this process computes it "
                            "eagerly (docs/receipts.md#field-kernels)", self.fallback)
        return chunk_receipts(*args, **kwargs), "eager"


PROCESS_KERNELS = ChunkKernels()
"""The process's chunk arithmetic, shared by every layer and gate (one compile per process)."""
