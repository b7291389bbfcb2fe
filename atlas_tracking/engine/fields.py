"""Field evaluation: raw expert outputs ``u_e(g)`` at (gate input, expert) pairs, wherever the experts live.

A gate asks a layer for the unweighted output of expert ``experts[i]`` at gate input ``rows[i]``.
:class:`LocalFields` answers with the layer's own experts in this process. A layer whose experts
are spread over an expert-parallel group is answered by :class:`ExpertParallelFields`: each request
goes to the rank that holds its expert with ``torch.distributed.all_to_all_single`` over the layer's
expert-parallel group (the exchange pattern of the layer's own dispatch), that rank evaluates it with
the model's own expert code, and the output comes back the same way.

Every rank of an expert-parallel group makes the same exchange calls in the same order, whatever
its number of tokens: :meth:`FieldEvaluator.calls` agrees on the number of calls of a micro-batch
(the largest over the group) and a rank with fewer requests sends empty ones.

Example (one process, every expert local):
    >>> import torch
    >>> from atlas_tracking.adapters.base import RoutedLayer
    >>> class Doubling(RoutedLayer):
    ...     def pair_outputs(self, rows, experts):
    ...         return rows * (experts.view(-1, 1) + 1)
    >>> fields = field_evaluator(Doubling("moe", 0, None, None, None, None))
    >>> fields.calls(3), fields(torch.ones(2, 4), torch.tensor([0, 1])).tolist()
    (3, [[1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
"""

from __future__ import annotations

from typing import Any

import torch

from atlas_tracking.adapters.base import RoutedLayer


class FieldEvaluator:
    """The one interface the capture calls for expert fields (``__call__``), and how many calls to make."""

    sent_bytes: int = 0
    """Bytes this process sent to other processes for field requests and answers (0 when local)."""

    def calls(self, wanted: int) -> int:
        """Number of calls every participant makes for a micro-batch that needs ``wanted`` calls here."""
        raise NotImplementedError

    def __call__(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``[M, d]`` raw outputs of expert ``experts[i]`` (global id) at ``rows[i]``."""
        raise NotImplementedError


class LocalFields(FieldEvaluator):
    """Every expert is held by this process: the layer's own experts call."""

    def __init__(self, layer: RoutedLayer):
        self.layer = layer

    def calls(self, wanted: int) -> int:
        return wanted

    def __call__(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return self.layer.pair_outputs(rows, experts)


class ExpertParallelFields(FieldEvaluator):
    """Requests for experts held elsewhere go to their owner over the expert-parallel group and come back.

    ``owner[e]`` is the group rank that holds expert ``e``. One call is four ``all_to_all_single``
    exchanges over the group: request counts, request rows, request expert ids, answers.
    """

    def __init__(self, layer: RoutedLayer, group: Any, owner: torch.Tensor):
        self.layer = layer
        self.group = group
        self.owner = owner.long()
        self.size = torch.distributed.get_world_size(group=group)
        self.rank = torch.distributed.get_rank(group=group)
        self.sent_bytes = 0

    def calls(self, wanted: int) -> int:
        n = torch.tensor([wanted], dtype=torch.int64, device=self._device())
        torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return int(n.item())

    def _device(self) -> torch.device:
        for p in self.layer.experts.parameters():
            return p.device if p.device.type != "meta" else torch.device("cpu")
        return torch.device("cpu")

    def _exchange(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
        torch.distributed.all_to_all_single(recv, send.contiguous(), recv_splits, send_splits, group=self.group)
        return recv

    def __call__(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        experts = experts.reshape(-1)
        dest = self.owner.to(experts.device)[experts]
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.size)
        recv_counts = self._exchange(send_counts, [1] * self.size, [1] * self.size)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        asked = self._exchange(rows.index_select(0, order), send_splits, recv_splits)
        asked_experts = self._exchange(experts.index_select(0, order), send_splits, recv_splits)
        if asked.shape[0] > 0:
            answers = self.layer.pair_outputs(asked, asked_experts).to(rows.dtype)
        else:
            answers = rows.new_empty((0, rows.shape[-1]))
        back = self._exchange(answers, recv_splits, send_splits)
        out = torch.empty_like(back).index_copy_(0, order, back)
        row_bytes = rows.shape[-1] * rows.element_size()
        away = sum(send_splits) - send_splits[self.rank]
        returned = sum(recv_splits) - recv_splits[self.rank]
        self.sent_bytes += away * (row_bytes + experts.element_size()) + returned * row_bytes + 8 * (self.size - 1)
        return out


def field_evaluator(layer: RoutedLayer) -> FieldEvaluator:
    """The evaluator a gate uses for ``layer``: over its expert-parallel group when it has one."""
    placement = layer.expert_placement()
    if placement is None:
        return LocalFields(layer)
    group, owner = placement
    return ExpertParallelFields(layer, group, owner)
