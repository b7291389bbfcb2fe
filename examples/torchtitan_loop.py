"""A plain PyTorch loop training torchtitan's DeepSeek-V3 MoE with atlas gates (CPU, no downloads, under a minute).

The model is torchtitan's own (``torchtitan.models.deepseek_v3``: sigmoid routing with the auxiliary-loss-free
load-balancing bias, node-limited groups, a shared expert, the experts' for-loop path). After every optimizer
step the expert bias moves as torchtitan's optimizer hook moves it (``components/optimizer.py``: the sign of
each expert's deficit against the mean load, times ``load_balance_coeff``, centred) and the load statistic is
reset. Every ``--every`` steps ``AtlasGate`` measures the canary, reads the gate and appends
``<out>/gates.jsonl``; a gate leaves ``tokens_per_expert`` as it found it, so the bias update never sees it.

    python examples/torchtitan_loop.py --out out/torchtitan --steps 100 --every 25
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from atlas_tracking import Canary
from atlas_tracking.gate import AtlasGate
from atlas_tracking.testing.demo_data import VOCAB_SIZE, encode, prose_text
from atlas_tracking.testing.torchtitan_cpu import cpu_histc_for_expert_counts, deepseek_v3


def update_expert_bias(model: torch.nn.Module) -> None:
    """torchtitan's auxiliary-loss-free balancing step for every MoE of ``model``, then a fresh load count."""
    with torch.no_grad():
        for block in model.layers.values():
            moe = getattr(block, "moe", None) if block.moe_enabled else None
            if moe is None or moe.load_balance_coeff is None:
                continue
            tokens = moe.tokens_per_expert
            delta = moe.load_balance_coeff * torch.sign(tokens.mean() - tokens)
            moe.expert_bias.add_(delta - delta.mean())
            tokens.zero_()


def batches(stream: np.ndarray, window: int, batch: int, seed: int):
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(stream) - window, size=batch)
        yield torch.from_numpy(np.stack([stream[s : s + window] for s in starts]).astype(np.int64))


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/torchtitan")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=25, help="gate cadence in steps")
    args = p.parse_args(argv)
    window, batch = 64, 8
    text = encode(prose_text())
    train, held_out = text[: len(text) * 9 // 10], text[len(text) * 9 // 10 :]
    canary = Canary.from_token_ids(held_out, window=window, n_windows=16, seed=0)
    val = next(batches(held_out, window, 16, seed=1))
    with cpu_histc_for_expert_counts():
        model = deepseek_v3(vocab=VOCAB_SIZE, dim=64)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gate = AtlasGate(model, canary, {"receipts": {"progress": False, "anchors": 256}}, out_dir=args.out,
                         forward=lambda m, ids: m(ids))
        data = batches(train, window, batch, seed=0)
        for step in range(args.steps + 1):
            if step % args.every == 0:
                with torch.no_grad():
                    model.eval()
                    val_loss = float(lm_loss(model, val))
                record = gate.run(step, loss=val_loss)
                print(f"step {step:4d}  val_loss {val_loss:.3f}  {record['status']:8s} {record['stage']:9s} "
                      f"c2 {record['c2']:+.4f}  dead {record['dead_experts']:.1f}")
            if step == args.steps:
                break
            model.train()
            loss = lm_loss(model, next(data))
            opt.zero_grad()
            loss.backward()
            opt.step()
            update_expert_bias(model)
        gate.finish()
    return Path(args.out) / "gates.jsonl"


if __name__ == "__main__":
    main()
