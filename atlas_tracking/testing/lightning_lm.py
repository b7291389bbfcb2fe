"""A small transformers MoE trained with Lightning on byte-level text (no downloads).

Used by the demo (``examples/demo.py``), the tests and the benchmarks. ``MoELM`` wraps a Qwen3-MoE from a config;
``ByteWindows`` samples training windows from a token stream with a fixed seed.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from atlas_tracking.testing.demo_data import VOCAB_SIZE


def build_qwen3_moe(seed: int = 0, hidden: int = 64, layers: int = 4, experts: int = 32, top_k: int = 2,
                    aux_coef: float = 0.02):
    """A Qwen3-MoE of about 1.6M parameters (4 routed layers, 32 experts, top-2, byte vocabulary)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=512, tie_word_embeddings=True,
        output_router_logits=aux_coef > 0, router_aux_loss_coef=aux_coef,
    )
    return Qwen3MoeForCausalLM(cfg)


class ByteWindows(Dataset):
    """``length`` windows of ``window`` tokens drawn from a stream with a fixed seed (same every epoch)."""

    def __init__(self, stream: np.ndarray, window: int, length: int, seed: int):
        rng = np.random.default_rng(seed)
        self.starts = rng.integers(0, len(stream) - window, size=length)
        self.stream, self.window = stream, window

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        s = self.starts[i]
        return torch.from_numpy(self.stream[s : s + self.window].astype(np.int64))


class MoELM(pl.LightningModule):
    """Causal LM training of a transformers MoE; ``freeze_routed`` freezes experts, router and FFN norms.

    ``aux_coef`` sets the model's load-balancing loss weight (0 disables it).
    """

    def __init__(self, model=None, lr: float = 3e-3, aux_coef: float = 0.02, freeze_routed: bool = False,
                 clip: float = 1.0, cosine_steps: int = 0, min_lr_ratio: float = 0.1):
        super().__init__()
        self.model = model if model is not None else build_qwen3_moe(aux_coef=aux_coef)
        self.model.router_aux_loss_coef = aux_coef
        self.lr, self.clip = lr, clip
        self.cosine_steps, self.min_lr_ratio = cosine_steps, min_lr_ratio
        self.set_frozen(freeze_routed)

    def set_frozen(self, freeze_routed: bool) -> None:
        """Freeze (or unfreeze) every expert, router and FFN-norm parameter (the routed object)."""
        for name, p in self.model.named_parameters():
            p.requires_grad = not (freeze_routed and (".mlp." in name or "post_attention_layernorm" in name))

    def forward(self, input_ids: torch.Tensor):
        return self.model(input_ids=input_ids, labels=input_ids)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self(batch).loss
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        """``val_loss`` is the next-token cross-entropy alone (the model's loss adds the load-balancing term,
        whose weight differs between runs; two runs' losses are compared at matched quality)."""
        logits = self.model(input_ids=batch).logits[:, :-1]
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        self.log("val_loss", ce, prog_bar=True, on_epoch=True, batch_size=batch.shape[0])

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0)
        if not self.cosine_steps:
            return opt
        total, floor = self.cosine_steps, self.min_lr_ratio

        def factor(step: int) -> float:
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.clip and math.isfinite(self.clip):
            self.clip_gradients(optimizer, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")


def loaders(stream: np.ndarray, val_stream: np.ndarray, window: int, batch: int, steps: int, seed: int,
            val_windows: int = 16) -> tuple[DataLoader, DataLoader]:
    """Training windows (one epoch = ``steps`` batches) and a fixed validation set."""
    train = DataLoader(ByteWindows(stream, window, steps * batch, seed), batch_size=batch, shuffle=False)
    val = DataLoader(ByteWindows(val_stream, window, val_windows, seed + 1), batch_size=val_windows)
    return train, val
