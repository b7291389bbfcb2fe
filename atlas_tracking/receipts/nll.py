"""State3: next-token negative log-likelihood on the canary windows.

Example:
    >>> import torch
    >>> logits = torch.zeros(1, 3, 4)            # uniform over 4 tokens
    >>> ids = torch.tensor([[0, 1, 2]])
    >>> s, n = window_nll(logits, ids)
    >>> round(float(s[0] / n[0]), 4), int(n[0])
    (1.3863, 2)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def window_nll(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-window sum of next-token NLL (nats, fp32) and the number of predicted tokens."""
    pred = logits[:, :-1].float()
    target = input_ids[:, 1:]
    nll = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1), reduction="none")
    nll = nll.view(target.shape)
    counts = torch.full((target.shape[0],), target.shape[1], dtype=torch.int64, device=target.device)
    return nll.sum(dim=1), counts
