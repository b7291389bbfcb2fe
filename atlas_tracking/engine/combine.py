"""The layer output a gate hands back when it evaluates the active experts itself (``receipts.fuse_experts``).

A gate never changes the model's numbers: downstream of every routed layer the hidden states are the
model's own, bit for bit, in the model's dtype and autocast context (docs/receipts.md#precision). When the
gate evaluates the active fields inside the experts' call, it can hand back their weighted sum instead of
calling the experts a second time, but only in the model's own arithmetic. Two combines cover the
transformers experts implementations:

- ``slots``: ``(u * w).sum(dim=1)`` over the model's top-k slots, in the product's dtype, cast to the
  hidden states' dtype (the ``grouped_mm`` and ``batched_mm`` implementations);
- ``ascending``: each product cast to the hidden states' dtype, then added one expert at a time in
  ascending expert order (the eager loop's ``index_add_`` over the experts it hits).

The first time a layer's experts run under a gate with a given arithmetic (:func:`arithmetic_key`), the capture
calls the experts' own forward as well and keeps a combine only if it equals that output bit for bit; otherwise
every call of that layer is the model's own call (``OWN``). Whether a combine reproduces the experts' forward
depends on their code and arithmetic, not on the numbers they hold, so the verdict is kept for later gates of
the same process (:class:`CombineVerdicts`) and found again whenever any part of the arithmetic changes.

Example (a product in bf16 accumulated two ways):
    >>> import torch
    >>> u = torch.tensor([[[1.0], [2.0 ** -8], [2.0 ** -8]]], dtype=torch.bfloat16)
    >>> w = torch.ones(1, 3, dtype=torch.bfloat16)
    >>> index = torch.tensor([[0, 1, 2]])
    >>> float(COMBINES["slots"](u, w, index, torch.bfloat16)), float(COMBINES["ascending"](u, w, index, torch.bfloat16))
    (1.0078125, 1.0)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

OWN = "own"
"""The layer's output is the model's own experts call (no combine reproduced it bit for bit)."""
UNFUSED = "unfused"
"""The gate did not stand in for the experts (``fuse_experts: false`` or a layer that cannot be fused)."""


def slot_sum(u: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum_j w_j u_j`` over the top-k slots in the order the model gave them (``u`` is ``[N, k, d]``)."""
    return (u * weights.unsqueeze(-1)).sum(dim=1).to(dtype)


def ascending_adds(u: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each ``w_j u_j`` cast to ``dtype``, added into zeros in ascending expert order (``index`` ``[N, k]``)."""
    n, k, d = u.shape
    order = index.argsort(dim=1, stable=True) + torch.arange(n, device=u.device).view(-1, 1) * k  # rows of w_j u_j
    terms = (u * weights.unsqueeze(-1)).reshape(-1, d).index_select(0, order.reshape(-1)).view(n, k, d).to(dtype)
    out = terms.new_zeros((u.shape[0], u.shape[-1]))
    for j in range(terms.shape[1]):
        out = out + terms[:, j]
    return out


COMBINES: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]] = {
    "slots": slot_sum,
    "ascending": ascending_adds,
}
"""The combines a gate may hand back, tried in this order when a layer's arithmetic is first seen."""
PATHS = (UNFUSED, OWN, *COMBINES)
"""Every way a layer's output came about in a gate, in the order of their codes in the per-window array."""


def arithmetic_key(forward: Any, module: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor,
                   weights: torch.Tensor) -> tuple:
    """Everything an experts call's arithmetic depends on besides the numbers: the forward's code (and a
    transformers experts implementation chosen by name), the shapes and dtypes of what it is handed and holds,
    the device, the autocast and grad modes, deterministic algorithms, the float32 matmul precision, and the
    combines on offer."""
    device = hidden.device.type
    param = next(module.parameters(), None)
    code = getattr(forward, "__func__", forward)
    return (_weakly(code), getattr(getattr(module, "config", None), "_experts_implementation", None),
            tuple(hidden.shape), hidden.dtype, index.dtype, weights.dtype, None if param is None else param.dtype,
            hidden.device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device),
            torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(),
            torch.get_float32_matmul_precision(), tuple(COMBINES))


def _weakly(obj: Any) -> Any:
    """``obj`` by a weak reference where it takes one: equal to another reference to it while it lives, and to
    nothing once it is gone (a new object at the same address is another forward); never keeping it alive (a
    wrapper may hold the module itself)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return obj


class CombineVerdicts:
    """Which combine reproduced an experts module's own forward, per arithmetic, in this process.

    Held weakly by module, so a verdict goes with its model.

    >>> verdicts, experts = CombineVerdicts(), torch.nn.Linear(2, 2)
    >>> verdicts.get(experts, ("key",)) is None
    True
    >>> verdicts.put(experts, ("key",), "slots")
    >>> verdicts.get(experts, ("key",))
    'slots'
    """

    def __init__(self) -> None:
        self._by_module: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, str]] = weakref.WeakKeyDictionary()

    def get(self, module: torch.nn.Module, key: tuple) -> str | None:
        """The verdict for ``module`` under ``key``; None when that arithmetic has not been checked here."""
        return self._by_module.get(module, {}).get(key)

    def put(self, module: torch.nn.Module, key: tuple, combine: str) -> None:
        self._by_module.setdefault(module, {})[key] = combine


VERDICTS = CombineVerdicts()
"""This process's verdicts (``engine/capture.py`` reads and writes them)."""
