"""transformers' fused experts evaluated the way their ``grouped_mm`` implementation evaluates them, stopping before the
weighted sum: the products the model sums are the gate's active fields.

A gate needs each active expert's unweighted output (its field) and the layer's output exactly as the model computes
it (docs/receipts.md#precision). transformers' ``grouped_mm`` experts implementation (``transformers.integrations.moe``)
sorts the (token, slot) pairs by expert, runs one grouped product per projection, then weights the products and sums
them per token. :func:`grouped_fields` takes the same steps on the same inputs (the same sort, the same products of
the same rows in the same groups) and returns the products before the weighting: they are the terms of the model's
own sum, so the ``slots`` combine (``engine/combine.py``) rebuilds the model's output from them, which the capture
checks bit for bit at the first call under each arithmetic. Asking the experts' forward for the same fields, one
(token, expert) pair a row with unit weights, costs a copy of every row, a product by the unit weights and a sum
over a single slot on ``[N k, d]`` tensors.

Further (row, expert) pairs, the competitors the gate evaluates, go through the same steps in groups of their own.
On the CPU a grouped product is one matrix product per expert; where an expert's weights are large
(:data:`INTERLEAVE_BYTES`), each expert's product for the further pairs runs right after its product for the active
pairs, while its weights are still in cache, instead of in a second pass over every expert's weights. Either way
each product has the rows, shapes and layout it has in a grouped product of its own, so the bits are the same.

Example (a tiny Qwen3-MoE; transformers supplies the experts code):
    >>> import torch
    >>> from transformers import Qwen3MoeConfig
    >>> from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    >>> cfg = Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=4, num_experts_per_tok=2)
    >>> cfg._experts_implementation = "grouped_mm"
    >>> experts = Qwen3MoeExperts(cfg)
    >>> _ = torch.nn.init.normal_(experts.gate_up_proj), torch.nn.init.normal_(experts.down_proj)
    >>> x, index, w = torch.randn(5, 8), torch.tensor([[0, 1], [2, 3], [1, 0], [3, 3], [0, 2]]), torch.rand(5, 2)
    >>> fields, (competitors,) = grouped_fields(experts, x, index, [(x, torch.tensor([[2], [0], [3], [1], [1]]))])
    >>> torch.equal((fields * w.unsqueeze(-1)).sum(dim=1), experts(x, index, w))   # the model's own output
    True
    >>> torch.allclose(competitors[1, 0], experts(x[1:2], torch.tensor([[0]]), torch.ones(1, 1))[0])
    True
    >>> e = torch.tensor([[2], [0], [3], [1], [1]])
    >>> (alone,) = pair_fields(experts, [(x, e)])          # the pairs alone: the experts' own call of those rows
    >>> torch.equal(alone[:, 0], experts(x, e, torch.ones(5, 1)))
    True
"""

from __future__ import annotations

import inspect
import itertools
import sys
from types import ModuleType

import numpy as np
import torch
from torch import nn

MOE_MODULE = "transformers.integrations.moe"
"""Where transformers keeps its experts implementations (read only once transformers has loaded it)."""


def grouped_implementation(experts: nn.Module) -> ModuleType | None:
    """transformers' experts module (``transformers.integrations.moe``) when ``experts`` runs its ``grouped_mm``
    implementation in this process, else None: the class's forward is the experts interface's dispatch, the config
    chooses ``grouped_mm``, that name is transformers' own function, and the experts are not spread over an
    expert-parallel group."""
    moe = sys.modules.get(MOE_MODULE)
    forward = getattr(type(experts), "forward", None)
    if moe is None or getattr(forward, "__globals__", None) is not vars(moe):
        return None
    implementation = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    interface = inspect.getclosurevars(forward).nonlocals.get("experts_interface")
    if implementation != "grouped_mm" or interface is None or getattr(experts, "_is_expert_parallel", True):
        return None
    if interface.get(implementation) is not getattr(moe, "grouped_mm_experts_forward", None):
        return None
    needed = ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm", "num_experts", "down_proj")
    return moe if all(hasattr(experts, name) for name in needed) else None


INTERLEAVE_BYTES = 1 << 16
"""On the CPU, a projection whose weights are at least this many bytes per expert runs expert by expert with the
further pairs' product right after the active one (its weights read from memory once); smaller ones run as grouped
products, one pass each. At 24 routed layers x 128 experts (``benchmarks/RESULTS.md`` (u)) a gate took the same time
either way at width 64 (32 and 16 KiB per expert), and less expert by expert at widths 128 and 256 (128 and 64 KiB,
512 and 256 KiB)."""


class _Groups:
    """(row, expert) pairs sorted by expert as ``grouped_mm_experts_forward`` sorts them (``perm``), the sorted
    inputs (``rows``) and the groups' ends (``offsets``, int32, as the grouped product reads them)."""

    def __init__(self, source: torch.Tensor, pair_rows: torch.Tensor | None, experts: torch.Tensor, n_experts: int,
                 per_row: int = 1):
        self.ids, self.perm = torch.sort(experts)
        rows = self.perm // per_row if pair_rows is None else pair_rows.index_select(0, self.perm)
        self.rows = source.index_select(0, rows)  # the same rows the model's indexing copies
        counts_input = self.ids.float() if experts.device.type in ("cpu", "mps") else self.ids.int()
        counts = torch.histc(counts_input, bins=n_experts, min=0, max=n_experts - 1)
        self.offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)

    def unsort(self, out: torch.Tensor) -> torch.Tensor:
        """The sorted products back in the pairs' own order (a gather by the inverse sort: faster than a scatter)."""
        inverse = torch.empty_like(self.perm).scatter_(0, self.perm, torch.arange(len(self.perm), device=out.device))
        return out.index_select(0, inverse)


def _weight(experts: nn.Module, first: bool) -> torch.Tensor:
    if not first:
        return experts.down_proj
    return experts.gate_up_proj if experts.has_gate else experts.up_proj


def _bias(experts: nn.Module, first: bool, groups: _Groups) -> torch.Tensor | None:
    if not experts.has_bias:
        return None
    name = "down_proj_bias" if not first else "gate_up_proj_bias" if experts.has_gate else "up_proj_bias"
    return getattr(experts, name)[groups.ids]


@torch.no_grad()
def _expert_by_expert(weight: torch.Tensor, transposed: bool, parts: list[tuple[_Groups, torch.Tensor]]
                      ) -> list[torch.Tensor]:
    """One projection of every part, expert by expert: each expert's product for each part in turn, ``torch.mm`` into
    its group's rows as the CPU's grouped product computes each group (so with the same bits)."""
    per_expert = (weight if transposed else weight.transpose(-2, -1)).unbind(0)
    inputs = [x.to(weight.dtype) for _, x in parts]
    outs = [x.new_empty((x.shape[0], per_expert[0].shape[-1])) for x in inputs]
    # the groups' sizes on the host, as the CPU's grouped product reads them: a read of host memory, no device waits
    counts = [np.diff(groups.offsets.numpy(), prepend=0).tolist() for groups, _ in parts]
    groups_of = [list(zip(rows, x.split(rows), out.split(rows))) for rows, x, out in zip(counts, inputs, outs)]
    for e, w in enumerate(per_expert):
        for rows, x, out in (part[e] for part in groups_of):
            if rows:
                torch.mm(x, w, out=out)
    return outs


def _interleaved(weight: torch.Tensor) -> bool:
    """Whether further pairs' products run right after the active ones, expert by expert, for this projection."""
    per_expert_bytes = weight[0].numel() * weight.element_size() if len(weight) else 0
    return weight.device.type == "cpu" and per_expert_bytes >= INTERLEAVE_BYTES


def interleaves(experts: nn.Module) -> bool:
    """Whether either projection of ``experts`` runs the further pairs' products expert by expert right after the
    active ones (on the CPU, weights of at least :data:`INTERLEAVE_BYTES` an expert): their weights are then read
    once for both, and the pairs are best evaluated in the active set's pass."""
    return any(_interleaved(_weight(experts, first)) for first in (True, False))


def _projection(experts: nn.Module, moe: ModuleType, first: bool, parts: list[tuple[_Groups, torch.Tensor]]
                ) -> list[torch.Tensor]:
    """One projection of every part (the first: gate and up, or up; else down), biases included."""
    weight = _weight(experts, first)
    if len(parts) > 1 and _interleaved(weight):
        outs = _expert_by_expert(weight, experts.is_transposed, parts)
        for out, (groups, _) in zip(outs, parts):
            bias = _bias(experts, first, groups)
            if bias is not None:
                out.add_(bias)  # after the product, as the grouped linear adds it
        return outs
    return [moe._grouped_linear(x, weight, groups.offsets, bias=_bias(experts, first, groups),
                                is_transposed=experts.is_transposed) for groups, x in parts]


def _products(experts: nn.Module, moe: ModuleType, parts: list[_Groups]) -> list[torch.Tensor]:
    """Each part's products, sorted by expert as its groups hold them: the grouped products of both projections with
    the model's own gate and activation between, and its post-expert norm where it has one."""
    hidden_parts = _projection(experts, moe, True, [(groups, groups.rows) for groups in parts])
    hidden_parts = [experts._apply_gate(h) if experts.has_gate else experts.act_fn(h) for h in hidden_parts]
    outs = _projection(experts, moe, False, list(zip(parts, hidden_parts)))
    return [experts.post_expert_norm(out) for out in outs] if experts.has_post_expert_norm else outs


def _pair_groups(pairs: list[tuple[torch.Tensor, torch.Tensor]], n_experts: int) -> _Groups:
    """Every (row, expert) pair of ``pairs`` (groups of rows ``[R, d]`` and experts ``[R, m]``) in one part."""
    starts = itertools.accumulate((len(rows) for rows, _ in pairs[:-1]), initial=0)
    pair_rows = torch.cat([start + torch.arange(e.numel(), device=e.device) // e.shape[-1]
                           for start, (_, e) in zip(starts, pairs)])
    return _Groups(torch.cat([rows for rows, _ in pairs]), pair_rows, torch.cat([e.reshape(-1) for _, e in pairs]),
                   n_experts)


def _split_pairs(groups: _Groups, out: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> list[torch.Tensor]:
    further = torch.split(groups.unsort(out), [e.numel() for _, e in pairs])
    return [part.view(*e.shape, -1) for part, (_, e) in zip(further, pairs)]


def _implementation(experts: nn.Module, moe: ModuleType | None) -> ModuleType:
    moe = moe if moe is not None else grouped_implementation(experts)
    if moe is None:
        raise ValueError(f"{type(experts).__name__} does not run transformers' grouped_mm experts implementation")
    return moe


def grouped_fields(experts: nn.Module, hidden: torch.Tensor, index: torch.Tensor,
                   pairs: list[tuple[torch.Tensor, torch.Tensor]] = (), moe: ModuleType | None = None
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The unweighted products ``[N, k, d]`` transformers' ``grouped_mm`` experts implementation sums for
    ``experts(hidden, index, weights)`` (``hidden [N, d]``, ``index [N, k]``), and those of each group of further
    ``pairs`` ((rows ``[R, d]``, experts ``[R, m]``) -> ``[R, m, d]``), in the products' dtype. ``moe`` is
    :func:`grouped_implementation`'s answer, found here when not given."""
    moe = _implementation(experts, moe)
    n_experts = int(experts.num_experts)
    n, k = index.shape
    parts = [_Groups(hidden, None, index.reshape(-1), n_experts, per_row=k)]
    if pairs:
        parts.append(_pair_groups(pairs, n_experts))
    outs = _products(experts, moe, parts)
    fields = parts[0].unsort(outs[0]).view(n, k, -1)
    return fields, (_split_pairs(parts[1], outs[1], pairs) if pairs else [])


def pair_fields(experts: nn.Module, pairs: list[tuple[torch.Tensor, torch.Tensor]], moe: ModuleType | None = None
                ) -> list[torch.Tensor]:
    """The products of ``pairs`` alone (groups of rows ``[R, d]`` and experts ``[R, m]`` -> ``[R, m, d]``), as
    :func:`grouped_fields` computes its further pairs: one grouped product per projection for all of them, so each
    product has the rows it has in ``experts``' own call of those rows with unit weights (the module's example)."""
    if not pairs:
        return []
    groups = _pair_groups(pairs, int(experts.num_experts))
    return _split_pairs(groups, _products(experts, _implementation(experts, moe), [groups])[0], pairs)
