"""Megatron-Core 0.16 on CUDA without Transformer Engine.

``megatron.core.transformer.moe.moe_utils`` imports ``te_general_gemm`` from Transformer Engine and defines nothing
when that import fails, yet its router gating linear (``RouterGatingLinearFunction``, which ``TopKRouter.gating``
calls on CUDA) tests ``te_general_gemm is not None``: without Transformer Engine every routed forward raises
``NameError``. ``transformer_engine_gemm_absent`` defines the name as None there while it is entered, so the
function takes the plain ``torch.mm`` / ``torch.addmm`` branch it has for that case; with Transformer Engine
installed it changes nothing.

Example:
    >>> from atlas_tracking.testing.megatron_te import transformer_engine_gemm_absent
    >>> from megatron.core.transformer.moe import moe_utils
    >>> with transformer_engine_gemm_absent():
    ...     moe_utils.te_general_gemm is None or moe_utils.HAVE_TE
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def transformer_engine_gemm_absent() -> Iterator[None]:
    """``moe_utils.te_general_gemm`` defined as None while entered, where Transformer Engine did not define it."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        yield
        return
    moe_utils.te_general_gemm = None
    try:
        yield
    finally:
        del moe_utils.te_general_gemm
