"""Fine-tune a tiny LitGPT MoE with Lightning and the atlas callback (CPU, no downloads, about a minute).

A LitGPT ``GPT`` with ``LLaMAMoE`` blocks (Mixtral-style: 8 experts, top-2, RMSNorm; a byte vocabulary)
is first trained briefly on Python's documentation prose, then fine-tuned on standard-library source
with ``AtlasCallback`` watching: the callback finds the LitGPT MoE blocks by class, measures the baseline
at fit start and a gate after every validation, and writes ``<out>/atlas/gates.jsonl``.

    python examples/litgpt_lightning.py --out out/litgpt --steps 120
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from atlas_tracking.integrations.lightning import AtlasCallback

from atlas_tracking import Canary
from atlas_tracking.testing.demo_data import VOCAB_SIZE, code_text, encode, prose_text
from atlas_tracking.testing.lightning_lm import loaders


def litgpt_moe(seed: int = 0, layers: int = 2, width: int = 64, experts: int = 8):
    """A LitGPT ``GPT`` whose MLPs are ``LLaMAMoE`` blocks (Mixtral-style routing)."""
    from litgpt.config import Config
    from litgpt.model import GPT

    torch.manual_seed(seed)
    return GPT(Config(n_layer=layers, n_embd=width, n_head=4, n_query_groups=2, vocab_size=VOCAB_SIZE,
                      padded_vocab_size=VOCAB_SIZE, block_size=128, mlp_class_name="LLaMAMoE", n_expert=experts,
                      n_expert_per_token=2, intermediate_size=2 * width, moe_intermediate_size=width,
                      norm_class_name="RMSNorm", bias=False, parallel_residual=False, rotary_percentage=1.0))


class LitGPTModule(pl.LightningModule):
    """Next-token training of a LitGPT model; ``forward(ids)`` returns the logits (what a gate calls)."""

    def __init__(self, model, lr: float = 3e-3):
        super().__init__()
        self.model, self.lr = model, lr

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)

    def _loss(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), on_epoch=True, batch_size=batch.shape[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr)


def _trainer(out: Path, steps: int, every: int, callbacks: list) -> pl.Trainer:
    return pl.Trainer(default_root_dir=str(out), max_steps=steps, val_check_interval=every, accelerator="cpu",
                      devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks)


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/litgpt")
    p.add_argument("--steps", type=int, default=120, help="fine-tuning steps (gates every steps/4)")
    p.add_argument("--pretrain-steps", type=int, default=60)
    args = p.parse_args(argv)
    out = Path(args.out)
    window, batch = 64, 8
    prose, code = encode(prose_text()), encode(code_text(400_000))
    module = LitGPTModule(litgpt_moe())

    train, val = loaders(prose[: len(prose) * 9 // 10], prose[len(prose) * 9 // 10 :], window, batch,
                         args.pretrain_steps, seed=0)
    _trainer(out / "pretrain", args.pretrain_steps, args.pretrain_steps, []).fit(module, train, val)

    canary = Canary.from_token_ids(np.concatenate([prose[-40_000:], code[-40_000:]]), window=window, n_windows=16,
                                   seed=0)
    every = max(1, args.steps // 4)
    callback = AtlasCallback(canary=canary, config={"receipts": {"progress": False, "anchors": 256}})
    train, val = loaders(code[: len(code) * 9 // 10], code[len(code) * 9 // 10 :], window, batch, args.steps, seed=1)
    _trainer(out, args.steps, every, [callback]).fit(module, train, val)
    gates = out / "atlas" / "gates.jsonl"
    print(f"{len(gates.read_text().splitlines())} gates in {gates}; last: {callback.last_record['status']} "
          f"({callback.last_record['stage']})")
    return gates


if __name__ == "__main__":
    main()
