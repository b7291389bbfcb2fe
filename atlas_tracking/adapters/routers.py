"""Router semantics: how a family's router output becomes exact selection scores and the model's own choice.

Two kinds cover the transformers families, each a small value in the family table:

- :class:`TopLogits`: routers that rank the raw logits (softmax then top-k, top-k then softmax,
  top-k then sigmoid): the selection scores are the logits themselves, in fp32;
- :class:`BiasedScores`: routers that rank a score function of the logits plus a correction bias,
  optionally inside a group limit (DeepSeek-V3's sigmoid + bias in the best groups, DeepSeek-V2's
  softmax with group-max masking, ERNIE 4.5's softmax + bias, MiniMax-M2's block-held bias, ...).
  Scores are recomputed with the router's own operations in the router's own dtypes, so the ranking
  is the model's, ties included.

The model's own choice (active set and combine weights) is always read from the router's forward
output (``read``), never recomputed from the scores, except for the two routers whose output does not
hold it (Llama 4's dense score matrix, JetMoE's expert-sorted gates, DBRX's bare logits), where the same
choice the model runs is repeated on the logits it returned.

    >>> import torch
    >>> logits = torch.tensor([[2.0, 0.5, 1.0, -1.0]])
    >>> scores, probs = TopLogits().selection(None, logits)
    >>> scores.tolist(), round(float(probs.sum()), 6)
    ([[2.0, 0.5, 1.0, -1.0]], 1.0)
    >>> groups = GroupLimit(n_group=2, topk_group=1)
    >>> s, _ = BiasedScores(bias=None, groups=groups).selection(None, logits)
    >>> torch.isinf(s).tolist()   # the weaker group (experts 2 and 3) is ineligible
    [[False, False, True, True]]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


def resolve(obj: Any, path: str | None) -> Any:
    """``obj.a.b`` for ``path = "a.b"`` (integer parts index module lists); None where an attribute is missing."""
    if path is None:
        return None
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def standard_read(layer: Any, out: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(router_logits, top_k_weights, top_k_index)``: the transformers 5.x router contract."""
    return out[0], out[1], out[2]


def _normalise(values: torch.Tensor) -> torch.Tensor:
    return values / values.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(values.dtype).tiny)


def distribution(gate: str, logits: torch.Tensor) -> torch.Tensor:
    """The full routing distribution p over experts: softmax of the logits, or the normalised sigmoid."""
    if gate == "softmax":
        return torch.softmax(logits.float(), dim=-1)
    return _normalise(torch.sigmoid(logits.float()))


@dataclass(frozen=True)
class TopLogits:
    """A router that ranks its raw logits; ``gate`` is how weights come from them ('softmax' or 'sigmoid',
    or a path such as ``"router.expert_selection_fn"`` to the router's own setting)."""

    gate: str = "softmax"
    kind: str = "softmax"
    read: Callable[[Any, Any], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = standard_read

    def selection(self, layer: Any, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate = self.gate if self.gate in ("softmax", "sigmoid") else resolve(layer, self.gate)
        return logits.float(), distribution(gate, logits)


@dataclass(frozen=True)
class GroupLimit:
    """Group-limited choice: experts outside the ``topk_group`` best of ``n_group`` groups are masked.

    ``n_group`` / ``topk_group`` are numbers or paths from the layer (``"router.num_group"``); a group
    scores the sum of its ``top`` best choice scores (DeepSeek-V3) or, with ``top=1``, its best one
    (DeepSeek-V2); masked experts get ``fill`` (``-inf``: ineligible; some models fill 0.0, which stays
    a competitor). ``when`` decides per layer whether the limit applies.
    """

    n_group: int | str = "router.num_group"
    topk_group: int | str = "router.topk_group"
    top: int | str = 2
    fill: float = float("-inf")
    when: Callable[[Any], bool] | None = None

    def mask(self, layer: Any, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` with the model's own group masking applied (in its dtype)."""
        n_group, topk_group, top = (int(v if isinstance(v, int) else resolve(layer, v))
                                    for v in (self.n_group, self.topk_group, self.top))
        n, e = choice.shape
        grouped = choice.view(n, n_group, e // n_group)
        group_scores = grouped.topk(top, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
        keep = keep.unsqueeze(-1).expand(n, n_group, e // n_group).reshape(n, e)
        return choice.masked_fill(~keep, self.fill)


@dataclass(frozen=True)
class BiasedScores:
    """A router that ranks ``score(logits) + bias``, optionally group-limited.

    ``score``: 'sigmoid', 'softmax', 'identity' (the logits), or a path to the router's own score function
    (``"router.score_fn"``); ``fp32``: the score is taken on fp32 logits (else in the logits' own dtype, as
    the router does); ``bias``: a path
    from the layer to the correction bias (``"router.e_score_correction_bias"``, ``"block.expert_bias"``;
    missing or None: no bias); ``gate``: how the combine weights come from the logits when not from the
    score itself (Kolibri ranks ``logits + bias`` and weighs by the sigmoid).
    """

    score: str = "sigmoid"
    bias: str | None = "router.e_score_correction_bias"
    groups: GroupLimit | None = None
    fp32: bool = True
    gate: str | None = None
    kind: str = "sigmoid"
    read: Callable[[Any, Any], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = standard_read

    def _score(self, layer: Any, logits: torch.Tensor) -> torch.Tensor:
        x = logits.float() if self.fp32 else logits
        if self.score == "sigmoid":
            return torch.sigmoid(x)
        if self.score == "softmax":
            return torch.softmax(x, dim=-1)
        if self.score == "identity":
            return x
        return resolve(layer, self.score)(x)

    def selection(self, layer: Any, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        score = self._score(layer, logits)
        bias = resolve(layer, self.bias)
        choice = score if bias is None else score + bias.reshape(-1)
        if self.groups is not None and (self.groups.when is None or self.groups.when(layer)):
            choice = self.groups.mask(layer, choice)
        gate = self.gate or self.score
        probs = distribution(gate, logits) if gate in ("softmax", "sigmoid") else _normalise(score.float())
        return choice.float(), probs


def llama4_read(layer: Any, out: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Llama 4's router returns ``(scores [N, E] with sigmoid(top logits) and 0 elsewhere, logits)``:
    the active set is the ``topk`` of the logits it runs itself, the weights its scores there."""
    scores, logits = out
    index = torch.topk(logits, layer.top_k, dim=1).indices
    return logits, scores.gather(1, index), index


def block_read(layer: Any, out: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routers that return only their logits while the block chooses and weighs (DBRX): the block's own
    ``route_tokens_to_experts``, repeated on the logits the router returned."""
    weights, index = layer.block.route_tokens_to_experts(out)
    return out, weights, index


def jetmoe_read(layer: Any, out: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """JetMoE's gating returns expert-sorted gates and the logits: its ``logits.topk`` and the softmax
    over the top logits, repeated as it runs them."""
    logits = out[4]
    top, index = logits.topk(layer.top_k, dim=1)
    return logits, F.softmax(top, dim=1), index
