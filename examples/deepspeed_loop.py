"""A DeepSpeed training loop with atlas gates (no Lightning): ``python examples/deepspeed_loop.py``.

A small language model whose blocks are ``deepspeed.moe.layer.MoE`` layers behind RMSNorms is
trained with ``deepspeed.initialize`` (ZeRO stage 1) on byte-level prose, on the CPU in one process.
Every ``--every`` steps the loop calls ``gate.run(step, loss)``: the same baseline, policy, local
``gates.jsonl`` record and tracker sinks as the Lightning callback.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))


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


def main(argv: list[str] | None = None) -> int:
    import deepspeed
    from atlas_tracking.integrations.deepspeed import deepspeed_layers
    from demo_data import encode, prose_text

    from atlas_tracking import Canary
    from atlas_tracking.gate import AtlasGate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--out", default="out/deepspeed/atlas")
    args = parser.parse_args(argv)
    init_single_process()
    text = encode(prose_text())
    canary = Canary.from_token_ids(text[-50_000:], window=64, n_windows=16, seed=0)
    model = TinyDSLM()
    config = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 1}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    gate = AtlasGate(engine.module, canary, {"receipts": {"progress": False}}, out_dir=args.out,
                     layers=deepspeed_layers(engine))
    rng = np.random.default_rng(0)
    loss: torch.Tensor | None = None
    for step in range(args.steps + 1):
        if step % args.every == 0:
            record = gate.run(step, loss=None if loss is None else loss.item())
            dropped = sum(layer.get("dropped_routes") or 0 for layer in record["layers"])
            print(f"step {step:4d} gate {record['status']:8s} {record['stage']:9s} c2={record['c2']:+.4f} "
                  f"dead={record['dead_experts']:.2f} dropped_routes={dropped}")
        if step == args.steps:
            break
        starts = rng.integers(0, len(text) - 65, 8)
        ids = torch.from_numpy(np.stack([text[s : s + 64] for s in starts]))
        logits = engine(ids)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
    gate.finish()
    print(f"gate records: {gate.out_dir / 'gates.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
