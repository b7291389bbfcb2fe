"""A DeepSpeed training loop with atlas gates (no Lightning): ``python examples/deepspeed_loop.py``.

A small language model whose blocks are ``deepspeed.moe.layer.MoE`` layers behind RMSNorms is
trained with ``deepspeed.initialize`` (ZeRO stage 1) on byte-level prose, on the CPU in one process.
Every ``--every`` steps the loop calls ``gate.run(step, loss)``: the same baseline, policy, local
``gates.jsonl`` record and tracker sinks as the Lightning callback.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
from torch import nn

from atlas_tracking.testing.deepspeed_lm import TinyDSLM, init_single_process


def main(argv: list[str] | None = None) -> int:
    import deepspeed
    from atlas_tracking.integrations.deepspeed import deepspeed_layers

    from atlas_tracking import Canary
    from atlas_tracking.gate import AtlasGate
    from atlas_tracking.testing.demo_data import encode, prose_text

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
