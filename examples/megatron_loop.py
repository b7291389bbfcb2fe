"""A Megatron-Core training loop with atlas gates, on one CUDA GPU or on the CPU: ``python examples/megatron_loop.py``.

A small ``GPTModel`` with MoE layers (sigmoid router, group-limited top-k, SequentialMLP experts,
local layer spec with the pure-torch ``DotProductAttention``) trains on byte-level prose. Every
``--every`` steps the loop calls ``gate.run(step, loss)`` and writes ``gates.jsonl`` under ``--out``.

With CUDA the run is as before: NCCL process group, ``model_parallel_cuda_manual_seed``, a router
with expert bias and the alltoall token dispatcher.

Without CUDA the model trains end to end on one gloo rank (world size 1). The set-up lives in
``atlas_tracking.testing.megatron_cpu``, which the tests share. That module's docstring
explains each item:

* ``cpu_stand_in_for_router_gating`` replaces ``TopKRouter.gating``. The real gating moves the
  router weights to CUDA. The stand-in computes the same gating linear on the CPU.
* ``CPUGlobalMemoryBuffer`` allocates the attention's scratch buffer on the CPU.
* RNG: Megatron's no-op-fork tracker plus a seeded torch CPU generator.
* The allgather dispatcher replaces the alltoall one. With one rank both route and combine the
  same tokens, and the alltoall dispatcher creates a CUDA stream.
* The expert bias is off. Its buffers are allocated on CUDA, and it stays zero in this loop
  anyway (nothing calls Megatron's bias update).
* The causal mask is passed explicitly; Megatron's default one is built on CUDA.

The defaults (100 steps, a gate every 25) take about 25 s on an otherwise idle 2-core CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import numpy as np
import torch


def build_model(vocab: int = 256, seq: int = 128, **config_overrides):
    """The example's GPTModel; ``config_overrides`` replace ``TransformerConfig`` fields (e.g. ``CPU_CONFIG``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=4, hidden_size=128, num_attention_heads=4, num_moe_experts=16, moe_router_topk=2,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=4,
        moe_router_group_topk=2, moe_router_topk_scaling_factor=2.0, moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="alltoall", normalization="RMSNorm", add_bias_linear=False,
        params_dtype=torch.float32, use_cpu_initialization=True,
    )
    config = TransformerConfig(**{**fields, **config_overrides})
    spec = get_gpt_layer_local_spec(num_experts=16, moe_grouped_gemm=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq)


def main(argv: list[str] | None = None) -> int:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from atlas_tracking import Canary
    from atlas_tracking.gate import AtlasGate
    from atlas_tracking.testing.demo_data import encode, prose_text

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--out", default="out/megatron/atlas")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if torch.cuda.is_available():
            from atlas_tracking.testing.megatron_te import transformer_engine_gemm_absent

            device = "cuda"
            stack.enter_context(transformer_engine_gemm_absent())  # Megatron-Core 0.16 without Transformer Engine
            for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29571", RANK="0", WORLD_SIZE="1").items():
                os.environ.setdefault(key, value)
            torch.distributed.init_process_group("nccl")
            parallel_state.initialize_model_parallel(1, 1)
            model_parallel_cuda_manual_seed(0)
            model = build_model().cuda()
            mask = None
        else:  # see atlas_tracking.testing.megatron_cpu for each stand-in and setting
            from atlas_tracking.testing.megatron_cpu import CPU_CONFIG, causal_mask, megatron_on_one_cpu_rank

            device = "cpu"
            stack.enter_context(megatron_on_one_cpu_rank(seed=0))
            model = build_model(**CPU_CONFIG)
            mask = causal_mask(128)
        text = encode(prose_text())
        canary = Canary.from_token_ids(text[-100_000:], window=128, n_windows=32, seed=0)
        positions = torch.arange(128, device=device).unsqueeze(0)

        def forward(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
            return m(ids, positions.expand(ids.shape[0], -1), mask)

        gate = AtlasGate(model, canary, {"receipts": {"progress": False}}, out_dir=args.out, forward=forward)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        rng = np.random.default_rng(0)
        loss = None
        for step in range(args.steps + 1):
            if step % args.every == 0:
                record = gate.run(step, loss=None if loss is None else loss.item())
                print(f"step {step:4d} {record['status']:8s} {record['stage']:9s} c2={record['c2']:+.4f} "
                      f"dead={record['dead_experts']:.2f}")
            if step == args.steps:
                break
            starts = rng.integers(0, len(text) - 129, 8)
            ids = torch.from_numpy(np.stack([text[s : s + 128] for s in starts])).to(device)
            logits = forward(model, ids)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
        gate.finish()
    print(f"gate records: {gate.out_dir / 'gates.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
