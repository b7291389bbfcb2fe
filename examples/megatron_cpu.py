"""CPU stand-ins for the CUDA-only pieces of Megatron-Core, so that its models run on a CPU-only machine.

These are mocks, named as such: each replaces a CUDA placement or CUDA state, never arithmetic.

- ``TopKRouter.gating``: the real one moves the router weights to CUDA before ``F.linear``; the
  stand-in computes the same fp32 logits where the weights are.
- ``GlobalMemoryBuffer.get_tensor``: the real one preallocates attention's scratch buffer with
  ``device=torch.cuda.current_device()``; the stand-in allocates it on the CPU.
- ``tensor_parallel.get_cuda_rng_tracker``: the real tracker forks CUDA RNG states around attention
  dropout; the stand-in's fork does nothing, so it is only valid with dropout 0 (``cpu_stand_ins``
  checks nothing else: the model config must set ``attention_dropout=0.0``).

``cpu_stand_ins()`` installs all three and restores the originals on exit; ``init_single_process``
creates the one-rank gloo process group and Megatron's model-parallel groups where they do not exist.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F


def _cpu_gating(self, inp: torch.Tensor) -> torch.Tensor:
    """Stand-in for ``TopKRouter.gating``: fp32 router logits, computed on the weights' device."""
    return F.linear(inp.float(), self.weight.float())


def _cpu_buffer(self, tensor_shape, dtype, name, mem_alloc_context=None) -> torch.Tensor:
    """Stand-in for ``GlobalMemoryBuffer.get_tensor``: a fresh CPU tensor instead of a CUDA scratch buffer."""
    return torch.empty(tensor_shape, dtype=dtype)


class _NoRngTracker:
    """Stand-in for Megatron's CUDA RNG tracker: ``fork`` does nothing (valid with dropout 0 only)."""

    def fork(self, name: str = "model-parallel-rng") -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


@contextlib.contextmanager
def cpu_stand_ins() -> Iterator[None]:
    """Install the three stand-ins above for the duration of the block."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.utils import GlobalMemoryBuffer

    saved = (TopKRouter.gating, GlobalMemoryBuffer.get_tensor, tensor_parallel.get_cuda_rng_tracker)
    TopKRouter.gating = _cpu_gating
    GlobalMemoryBuffer.get_tensor = _cpu_buffer
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: _NoRngTracker()
    try:
        yield
    finally:
        TopKRouter.gating, GlobalMemoryBuffer.get_tensor, tensor_parallel.get_cuda_rng_tracker = saved


def init_single_process() -> Callable[[], None]:
    """One gloo rank on 127.0.0.1 (a free port) and Megatron's model-parallel groups of size 1, unless
    they exist already; returns the teardown of what this call created."""
    from megatron.core import parallel_state

    created_group = not torch.distributed.is_initialized()
    if created_group:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    created_parallel = not parallel_state.model_parallel_is_initialized()
    if created_parallel:
        parallel_state.initialize_model_parallel(1, 1)

    def teardown() -> None:
        if created_parallel:
            parallel_state.destroy_model_parallel()
        if created_group:
            torch.distributed.destroy_process_group()

    return teardown
