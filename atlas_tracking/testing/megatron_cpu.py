"""Megatron-Core on one CPU rank: the stand-ins and settings that ``examples/megatron_loop.py`` and
``tests/integrations/test_megatron.py`` use where Megatron-Core's own code only runs on CUDA.

Stand-ins (each replaces one piece of Megatron code whose only CUDA dependence is where it puts
tensors; the arithmetic is unchanged):

* ``cpu_stand_in_for_router_gating`` replaces ``TopKRouter.gating``. The real gating first moves
  the router weight (and bias) to ``torch.cuda.current_device()``, so it cannot run without CUDA.
  The stand-in computes the same gating linear in the same routing dtype on the weights where they
  are. It does not call ``moe_utils.router_gating_linear``: in Megatron-Core 0.16 that function
  refers to ``te_general_gemm``, which is undefined when Transformer Engine is not installed.
* ``CPUGlobalMemoryBuffer`` replaces the process-wide ``GlobalMemoryBuffer``. Its ``get_tensor``
  allocates on ``torch.cuda.current_device()``. The pure-torch ``DotProductAttention`` of the local
  layer spec takes its scratch tensor for ``baddbmm(..., beta=0)`` from it.

Settings (no code replaced):

* A gloo process group of world size 1 and model-parallel sizes 1.
* RNG: ``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)``. That is Megatron's
  tracker whose ``fork()`` is a no-op, so nothing reads CUDA RNG state. It is meant for
  inference. With tensor parallelism 1 a separate model-parallel stream changes no semantics, so
  attention dropout draws from torch's CPU generator like every other op. That generator is seeded
  with ``torch.manual_seed(seed)``, as Megatron's own training setup does, and it also drives the
  ``use_cpu_initialization`` weight init.
* ``CPU_CONFIG``: ``TransformerConfig`` fields that differ on CPU. The alltoall dispatcher creates a
  ``torch.cuda.Stream`` in its constructor. With one rank the allgather dispatcher routes and
  combines the same tokens. ``TopKRouter`` allocates its expert-bias buffers on CUDA, so they are
  off. The sigmoid top-k with an all-zero bias equals the top-k without one. A plain loop that
  never calls Megatron's bias update (``finalize_model_grads``) keeps the bias at zero.
* ``causal_mask``: Megatron builds its default causal mask on CUDA when ``attention_mask`` is
  None (``transformer.utils.get_default_causal_mask``). On CPU the same mask is passed explicitly.
"""

from __future__ import annotations

import contextlib
import math
import socket
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as mpu_random
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.utils import GlobalMemoryBuffer

CPU_CONFIG = {"moe_token_dispatcher_type": "allgather", "moe_router_enable_expert_bias": False}


def cpu_stand_in_for_router_gating(self, input: torch.Tensor) -> torch.Tensor:
    """CPU stand-in for ``megatron.core.transformer.moe.router.TopKRouter.gating``.

    The real method moves the router weight and bias to CUDA and then applies the gating linear
    in the routing dtype (``moe_router_dtype`` fp32/fp64, else the input's dtype). This computes
    the same ``input @ weight.T (+ bias)`` in that dtype, with the parameters left on the CPU.
    """
    dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
    bias = None if self.bias is None else self.bias.to(dtype)
    return F.linear(input.to(dtype), self.weight.to(dtype), bias)


@contextlib.contextmanager
def cpu_router_gating() -> Iterator[None]:
    """Use ``cpu_stand_in_for_router_gating`` as ``TopKRouter.gating`` inside the block. The
    previous method is restored afterwards."""
    original = TopKRouter.gating
    TopKRouter.gating = cpu_stand_in_for_router_gating
    try:
        yield
    finally:
        TopKRouter.gating = original


class CPUGlobalMemoryBuffer(GlobalMemoryBuffer):
    """CPU stand-in for Megatron's ``GlobalMemoryBuffer``. It works the same way (one reused tensor
    per name and dtype, grown when too small) but allocates on the CPU and not on
    ``torch.cuda.current_device()``."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        required_len = math.prod(tensor_shape)
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < required_len:
            self.buffer[(name, dtype)] = buffer = torch.empty(required_len, dtype=dtype, requires_grad=False)
        return buffer[0:required_len].view(*tensor_shape)


def causal_mask(seq: int) -> torch.Tensor:
    """The mask Megatron's ``get_default_causal_mask`` builds on CUDA: True above the diagonal (masked)."""
    return torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)


@contextlib.contextmanager
def megatron_on_one_cpu_rank(seed: int = 0) -> Iterator[None]:
    """Megatron-Core state for one CPU process inside the block, as described in the module docstring.

    It reuses a process group or model-parallel state that already exists and tears down only
    what it created. The global memory buffer, the RNG tracker and ``TopKRouter.gating`` are
    restored or reset on exit.
    """
    created_group = not torch.distributed.is_initialized()
    if created_group:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    created_parallel = not parallel_state.model_parallel_is_initialized()
    if created_parallel:
        parallel_state.initialize_model_parallel(1, 1)
    saved_buffer = parallel_state._GLOBAL_MEMORY_BUFFER
    parallel_state._GLOBAL_MEMORY_BUFFER = CPUGlobalMemoryBuffer()
    mpu_random.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    torch.manual_seed(seed)
    try:
        with cpu_router_gating():
            yield
    finally:
        mpu_random.initialize_rng_tracker(force_reset=True)
        parallel_state._GLOBAL_MEMORY_BUFFER = saved_buffer
        if created_parallel:
            parallel_state.destroy_model_parallel()
        if created_group:
            torch.distributed.destroy_process_group()
