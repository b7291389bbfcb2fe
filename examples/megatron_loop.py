"""A Megatron-Core training loop with atlas gates: ``python examples/megatron_loop.py``.

A small ``GPTModel`` with MoE layers (local layer spec, SequentialMLP experts, group-limited top-k)
trains on byte-level prose; every ``--every`` steps the loop calls ``gate.run(step, loss)``.

On a CUDA GPU (NCCL, one rank) the router is a sigmoid with expert bias and the alltoall dispatcher.
On a CPU-only machine it runs on one gloo rank with three named stand-ins for Megatron-Core's
CUDA-only pieces (router gating, attention's scratch buffer, the CUDA RNG tracker; see
``megatron_cpu.py``) and the CPU-constructible options: a softmax router (the expert-bias buffers
are allocated on CUDA), the allgather dispatcher (alltoall creates a CUDA stream), dropout 0 and
an explicit causal mask (the default one is built on CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SEQ = 128


def build_model(cpu: bool, vocab: int = 256, seq: int = SEQ):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    router = ({"moe_router_score_function": "softmax"} if cpu else
              {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True})
    config = TransformerConfig(
        num_layers=4, hidden_size=128, num_attention_heads=4, num_moe_experts=16, moe_router_topk=2,
        moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.0,
        moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather" if cpu else "alltoall",
        normalization="RMSNorm", add_bias_linear=False, params_dtype=torch.float32, use_cpu_initialization=True,
        attention_dropout=0.0 if cpu else 0.1, hidden_dropout=0.0 if cpu else 0.1, **router,
    )
    spec = get_gpt_layer_local_spec(num_experts=16, moe_grouped_gemm=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--out", default="out/megatron/atlas")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    with contextlib.ExitStack() as stack:
        if cpu:
            from megatron_cpu import cpu_stand_ins, init_single_process

            stack.enter_context(cpu_stand_ins())
            stack.callback(init_single_process())
        else:
            from megatron.core import parallel_state
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29571", RANK="0", WORLD_SIZE="1").items():
                os.environ.setdefault(key, value)
            torch.distributed.init_process_group("nccl")
            parallel_state.initialize_model_parallel(1, 1)
            model_parallel_cuda_manual_seed(0)
            stack.callback(_teardown)
        torch.manual_seed(0)
        device = torch.device("cpu" if cpu else "cuda")
        model = build_model(cpu).to(device)
        return train(model, device, args)


def train(model: torch.nn.Module, device: torch.device, args: argparse.Namespace) -> int:
    """Byte-level LM training with a gate every ``args.every`` steps, recorded under ``args.out``."""
    from demo_data import encode, prose_text

    from atlas_tracking import Canary
    from atlas_tracking.gate import AtlasGate

    text = encode(prose_text())
    canary = Canary.from_token_ids(text[-100_000:], window=SEQ, n_windows=32, seed=0)
    positions = torch.arange(SEQ, device=device).unsqueeze(0)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device=device), diagonal=1).view(1, 1, SEQ, SEQ)

    def forward(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return m(ids, positions.expand(ids.shape[0], -1), causal)

    gate = AtlasGate(model, canary, {"receipts": {"progress": False}}, out_dir=args.out, forward=forward)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    rng = np.random.default_rng(0)
    loss = None
    for step in range(args.steps + 1):
        if step % args.every == 0:
            record = gate.run(step, loss=None if loss is None else loss.item())
            print(f"step {step:4d} {record['status']:8s} {record['stage']:9s} c2={record['c2']:+.4f} "
                  f"dead={record['dead_experts']:.2f} loss={'-' if loss is None else f'{loss.item():.3f}'}")
        if step == args.steps:
            break
        starts = rng.integers(0, len(text) - SEQ - 1, 8)
        ids = torch.from_numpy(np.stack([text[s : s + SEQ] for s in starts])).to(device)
        logits = forward(model, ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"gate records: {Path(args.out) / 'gates.jsonl'}")
    return 0


def _teardown() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
