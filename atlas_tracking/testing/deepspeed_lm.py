"""A small language model of ``deepspeed.moe.layer.MoE`` blocks (the DeepSpeed example's model, shared with the tests).

DeepSpeed is imported when a block is built, so importing this module needs only torch.
"""

from __future__ import annotations

import os
import socket

import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm residual block around a DeepSpeed MoE layer."""

    def __init__(self, d: int, experts: int, k: int, **moe_kw):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.norm2 = nn.RMSNorm(d, eps=1e-6)
        expert = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.moe = MoE(hidden_size=d, expert=expert, num_experts=experts, k=k, min_capacity=0, **moe_kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm2(x))[0]


class TinyDSLM(nn.Module):
    """Embedding, pre-norm DeepSpeed-MoE blocks, a final norm and an LM head."""

    def __init__(self, vocab: int = 256, d: int = 32, layers: int = 2, experts: int = 8, k: int = 2, seed: int = 0,
                 **moe_kw):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, experts, k, **moe_kw) for _ in range(layers)])
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def init_single_process() -> None:
    """A one-process gloo group on 127.0.0.1 (DeepSpeed's MoE needs process groups)."""
    import deepspeed

    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                               LOCAL_RANK="0").items():
            os.environ.setdefault(key, value)
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
