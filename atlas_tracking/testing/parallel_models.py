"""Models with the same weights however their experts are placed, and the gloo workers that measure them.

Every parameter is drawn from a generator seeded by its *global* name (an expert's name carries its
global expert id, whichever process holds it), so a model whose experts are spread over an
expert-parallel group holds exactly the weights of the one-process model. ``perturbed`` adds a second
seeded draw, the same everywhere: the checkpoint that drift is measured against a baseline from.
"""

from __future__ import annotations

import contextlib
import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from atlas_tracking import AtlasConfig, Baseline, Canary, measure
from atlas_tracking.engine.measure import RankDisagreementError


def config(batch_windows: int = 2, token_chunk: int | None = None) -> AtlasConfig:
    return AtlasConfig.from_dict({"receipts": {"progress": False, "n_bootstrap": 200, "anchors": 64,
                                               "batch_windows": batch_windows, "token_chunk": token_chunk}})


CFG = config()
"""Two windows per micro-batch: 8 windows make 4 micro-batches, 2 per process on 2 processes."""


def canary(n_windows: int = 8, seed: int = 0) -> Canary:
    return Canary.from_token_ids(np.random.default_rng(seed).integers(0, 64, 6000), window=16, n_windows=n_windows,
                                 seed=0)


def _draw(name: str, shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))


def fill_(model: nn.Module, global_name, perturb: float = 0.0) -> None:
    """Every parameter from its global name: routers spread (std 1), norm gains near 1, the rest std 0.3;
    ``perturb`` adds ``perturb`` times a second seeded draw."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = global_name(name)
            if re.search(r"(norm|layernorm)\.weight$", g):
                value = 1.0 + 0.1 * _draw(g, p.shape)
            elif re.search(r"(\.gate\.wg|\.router|mlp\.gate)\.weight$", g):
                value = _draw(g, p.shape)
            else:
                value = 0.3 * _draw(g, p.shape)
            if perturb:
                value = value + perturb * _draw(g + "/perturbed", p.shape)
            if hasattr(p, "device_mesh"):  # an FSDP2 shard (DTensor): this process's part of the same values
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(value, p.device_mesh, p.placements)
            p.copy_(value.to(p.dtype))


# --- DeepSpeed MoE --------------------------------------------------------------------------------

def ds_moe(ep_size: int = 1, ep_rank: int = 0, perturb: float = 0.0, experts: int = 8, d: int = 16,
           drop_tokens: tuple[bool, bool] = (True, True), k: int = 2) -> nn.Module:
    """examples/deepspeed_loop.py's model: 2 DeepSpeed-MoE layers, ``experts`` experts, top-``k``, width ``d``.

    ``drop_tokens`` per layer: True drops routes beyond a capacity computed from the micro-batch's own
    tokens (the dispatch then needs the same token count on every rank); False sizes the capacity by an
    ``all_reduce`` over the expert-parallel group inside the router (every router call is a collective).
    At ``k=1`` the gate keeps DeepSpeed's default random token selection (``use_rts=True``): which tokens
    over capacity it drops is a random draw."""
    from atlas_tracking.testing.deepspeed_lm import TinyDSLM

    model = TinyDSLM(vocab=64, d=d, layers=2, experts=experts, k=k, ep_size=ep_size)
    for block, drop in zip(model.blocks, drop_tokens):
        block.moe.deepspeed_moe.gate.drop_tokens = drop
    fill_(model, ds_global_name(ep_size, ep_rank, experts), perturb)
    return model


def ds_global_name(ep_size: int, ep_rank: int, experts: int = 8):
    n_local = experts // ep_size
    return lambda name: re.sub(r"deepspeed_experts\.(\d+)\.",
                               lambda m: f"deepspeed_experts.{ep_rank * n_local + int(m.group(1))}.", name)


def ds_expert_parallel(rank: int, world: int, experts: int = 8, n_windows: int = 8, batch_windows: int = 2,
                       token_chunk: int | None = None, drop_tokens: tuple[bool, bool] = (True, True), k: int = 2,
                       ep_size: int | None = None) -> dict[str, Any]:
    """DeepSpeed MoE with ``ep_size`` (default: ``world``; 1 is plain data parallelism) under
    ``deepspeed.initialize``: a baseline gate, a gate of the perturbed weights against it, and a gate whose
    ranks hold different canaries (the error each rank saw)."""
    import deepspeed

    from atlas_tracking.integrations.deepspeed import deepspeed_layers

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    ep = world if ep_size is None else ep_size
    ep_rank = rank % ep
    model = ds_moe(ep, ep_rank, experts=experts, drop_tokens=drop_tokens, k=k)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_batch_size": world, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}})
    layers = deepspeed_layers(engine)
    c, cfg = canary(n_windows), config(batch_windows, token_chunk)
    gate0 = measure(engine.module, c, config=cfg, layers=layers)
    fill_(engine.module, ds_global_name(ep, ep_rank, experts), perturb=0.05)
    gate1 = measure(engine.module, c, baseline=Baseline.from_report(gate0), config=cfg, layers=layers)
    return {"gate0": json.loads(gate0.to_json()), "gate1": json.loads(gate1.to_json()),
            "disagreement": _disagreement(engine.module, layers, c, rank)}


def _disagreement(model: nn.Module, layers: list, c: Canary, rank: int) -> str | None:
    """Rank 1 measures another canary: every rank must get the same clear error, before any forward."""
    try:
        measure(model, canary(len(c.windows), seed=1) if rank == 1 else c, config=CFG, layers=layers)
    except RankDisagreementError as exc:
        return str(exc)
    return None


def reference(build, n_windows: int = 8, batch_windows: int = 2,
              token_chunk: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same two gates on one process: ``build(perturb)`` makes the one-process model."""
    c, cfg = canary(n_windows), config(batch_windows, token_chunk)
    gate0 = measure(build(0.0), c, config=cfg)
    gate1 = measure(build(0.05), c, baseline=Baseline.from_report(gate0), config=cfg)
    return json.loads(gate0.to_json()), json.loads(gate1.to_json())


# --- a transformers family, replicated ------------------------------------------------------------

def family_replicated(rank: int, world: int, name: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tiny model of family ``name`` (``atlas_tracking.testing.families``, config keys ``overrides`` replaced)
    on every process, as under DDP: a baseline gate, and a gate of the model drawn from another seed against it
    (on one process: the reference)."""
    from atlas_tracking.testing.families import family_model

    c, keys = canary(), overrides or {}
    gate0 = measure(family_model(name, **keys), c, config=CFG)
    gate1 = measure(family_model(name, seed=1, **keys), c, baseline=Baseline.from_report(gate0), config=CFG)
    return {"gate0": json.loads(gate0.to_json()), "gate1": json.loads(gate1.to_json())}


def kernels_fallback(rank: int, world: int, failed: list[list[int]]) -> list[list[dict[str, Any]]]:
    """Gates of :func:`qwen3_moe` on every process, as under DDP, one for each list of ``failed``: the processes
    whose compile of the field arithmetic failed before it (their ``ChunkKernels.fallback`` set); each gate's layers'
    self-checks."""
    from atlas_tracking.engine.kernels import PROCESS_KERNELS

    cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "n_bootstrap": 20, "batch_windows": 2}})
    checks = []
    for ranks in failed:
        PROCESS_KERNELS.fallback = f"RuntimeError: no C++ compiler on rank {rank}" if rank in ranks else None
        checks.append([layer["selfcheck"] for layer in measure(qwen3_moe(), canary(), config=cfg).to_dict()["layers"]])
    return checks


# --- DeepSpeed AutoEP -----------------------------------------------------------------------------

def qwen3_moe(perturb: float = 0.0, experts: int = 8, d: int = 32) -> nn.Module:
    """A tiny transformers Qwen3-MoE: 2 layers, ``experts`` experts, top-2, width ``d``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=d, intermediate_size=48, moe_intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=experts, num_experts_per_tok=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    fill_(model, lambda name: name, perturb)
    return model


def autoep(ep_size: int = 1, ep_rank: int = 0, perturb: float = 0.0, d: int = 32) -> nn.Module:
    """``qwen3_moe`` with its MoE blocks replaced by DeepSpeed AutoEP layers holding experts of ``ep_rank``."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_presets.base import AutoEPConfig

    model = qwen3_moe(perturb, d=d)
    replacer = AutoEP(model, AutoEPConfig(enabled=True, autoep_size=ep_size))
    for spec in replacer.ep_parser():
        replacer._replace_moe_layer_without_retarget(spec, ep_size=ep_size, ep_rank=ep_rank)
    if ep_size > 1:
        for m in model.modules():
            if type(m).__name__ == "AutoEPMoELayer":
                m.set_deepspeed_parallelism()
    return model


def autoep_expert_parallel(rank: int, world: int) -> dict[str, Any]:
    """AutoEP with ``ep_size = world``: the two gates of ``ds_expert_parallel``."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    c = canary()
    gate0 = measure(autoep(world, rank), c, config=CFG)
    gate1 = measure(autoep(world, rank, perturb=0.05), c, baseline=Baseline.from_report(gate0), config=CFG)
    return {"gate0": json.loads(gate0.to_json()), "gate1": json.loads(gate1.to_json())}


# --- Megatron-Core --------------------------------------------------------------------------------

class MegatronMoEStack(nn.Module):
    """Embedding, two Megatron ``TransformerLayer``s used for their pre-MLP norm and ``MoELayer`` (8 experts,
    top-2, ``SequentialMLP``, allgather dispatcher), sequence-first hidden states, and an LM head."""

    def __init__(self, d: int = 32, vocab: int = 64):
        super().__init__()
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.spec_utils import build_module
        from megatron.core.transformer.transformer_config import TransformerConfig

        from atlas_tracking.testing.megatron_cpu import CPU_CONFIG

        cfg = TransformerConfig(num_layers=2, hidden_size=d, num_attention_heads=4, num_moe_experts=8,
                                moe_router_topk=2, moe_router_load_balancing_type="none", add_bias_linear=False,
                                normalization="RMSNorm", params_dtype=torch.float32, use_cpu_initialization=True,
                                **CPU_CONFIG)
        spec = get_gpt_layer_local_spec(num_experts=8)
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([build_module(spec, config=cfg, layer_number=i + 1) for i in range(2)])
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids).transpose(0, 1)  # [seq, batch, d]
        for layer in self.layers:
            out, bias = layer.mlp(layer.pre_mlp_layernorm(x))
            x = x + out + (bias if bias is not None else 0)
        return self.head(x.transpose(0, 1))


def megatron_stack(ep_size: int = 1, ep_rank: int = 0, perturb: float = 0.0, d: int = 32) -> nn.Module:
    model = MegatronMoEStack(d=d).eval()
    n_local = 8 // ep_size
    fill_(model, lambda name: re.sub(r"local_experts\.(\d+)\.",
                                     lambda m: f"local_experts.{ep_rank * n_local + int(m.group(1))}.", name), perturb)
    return model


@contextlib.contextmanager
def megatron_on_cpu(world: int) -> Iterator[None]:
    """Megatron-Core state for ``expert_model_parallel_size = world`` on CPU gloo processes (the group exists).

    Stand-ins: examples/megatron_cpu.py's for the router's CUDA-only gating and the scratch buffer, and
    ``torch.cuda.current_device()`` answering ``"cpu"`` inside the block: Megatron's expert-parallel
    gather and reduce-scatter (``tensor_parallel.mappings``) allocate their outputs there; the collectives
    themselves are Megatron's, over gloo."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mpu_random

    from atlas_tracking.testing.megatron_cpu import CPUGlobalMemoryBuffer, cpu_router_gating

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    parallel_state._GLOBAL_MEMORY_BUFFER = CPUGlobalMemoryBuffer()
    mpu_random.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        with cpu_router_gating():
            yield
    finally:
        torch.cuda.current_device = current_device
        parallel_state.destroy_model_parallel()


def megatron_expert_parallel(rank: int, world: int) -> dict[str, Any]:
    """Megatron-Core ``MoELayer`` with ``expert_model_parallel_size = world`` on CPU: the two gates of
    ``ds_expert_parallel``."""
    with megatron_on_cpu(world):
        c = canary()
        gate0 = measure(megatron_stack(world, rank), c, config=CFG)
        gate1 = measure(megatron_stack(world, rank, perturb=0.05), c, baseline=Baseline.from_report(gate0), config=CFG)
    return {"gate0": json.loads(gate0.to_json()), "gate1": json.loads(gate1.to_json())}


# --- sharded parameters ---------------------------------------------------------------------------

def held(p: torch.Tensor) -> int:
    """Elements of a parameter the module holds right now: 0 for a partitioned ZeRO-3 parameter (its partition
    is ``ds_tensor``), this process's shard for an FSDP2 parameter, all of them once gathered or unsharded."""
    local = getattr(p, "_local_tensor", None)
    return int((local if local is not None else p.data).numel())


def zero3(rank: int, world: int) -> dict[str, Any]:
    """A transformers Qwen3-MoE under ``deepspeed.initialize`` ZeRO stage 3 (every parameter partitioned:
    persistence threshold 0): the two gates, and what a process holds of an expert weight before and after."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    model = qwen3_moe()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_batch_size": world, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    return {**_sharded_gates(engine.module, lambda: fill_zero3(engine.module)), "gathered": _gathered(engine.module)}


def _gathered(model: nn.Module) -> list[list[int]]:
    """What the model holds of layer 0's norm and router weights outside a forward, inside
    ``atlas_tracking.engine.sharding.gathered`` and after it."""
    from atlas_tracking.engine.sharding import gathered

    modules = [model.model.layers[0].post_attention_layernorm, model.model.layers[0].mlp.gate]
    outside = [held(m.weight) for m in modules]
    with gathered(modules):
        inside = [held(m.weight) for m in modules]
    return [outside, inside, [held(m.weight) for m in modules]]


def fill_zero3(model: nn.Module) -> None:
    """``fill_(perturb=0.05)`` on ZeRO-3 partitioned parameters (gathered, modified on rank 0, re-partitioned)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        fill_(model, lambda name: name, perturb=0.05)


def fsdp2(rank: int, world: int) -> dict[str, Any]:
    """A transformers Qwen3-MoE with ``fully_shard`` on each decoder layer and on the model: the two gates,
    and what a process holds of an expert weight before and after."""
    from torch.distributed.fsdp import fully_shard

    model = qwen3_moe()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)

    return _sharded_gates(model, lambda: fill_(model, lambda name: name, perturb=0.05))


SHARDED_WINDOWS = 6
"""3 micro-batches of 2 windows on 2 processes: one process makes a filler call (the case that aborted FSDP2)."""


def _sharded_gates(model: nn.Module, perturb) -> dict[str, Any]:
    """The two gates, with what the model holds of each parameter before, between and after them."""
    c = canary(SHARDED_WINDOWS)
    before = [held(p) for p in model.parameters()]
    gate0 = measure(model, c, config=CFG)
    between = [held(p) for p in model.parameters()]
    perturb()
    gate1 = measure(model, c, baseline=Baseline.from_report(gate0), config=CFG)
    return {"gate0": json.loads(gate0.to_json()), "gate1": json.loads(gate1.to_json()), "held_before": before,
            "held_between": between, "held_after": [held(p) for p in model.parameters()],
            "full": [int(getattr(p, "ds_numel", p.numel())) for p in model.parameters()]}


def lightning_model_parallel(rank: int, world: int, root: str) -> dict[str, Any] | None:
    """Lightning's ``ModelParallelStrategy`` on CPU (FSDP2 over its data-parallel mesh in ``configure_model``)
    with ``AtlasCallback``: the step-0 gate rank 0 wrote (Lightning's ``FSDPStrategy`` refuses the CPU)."""
    import warnings

    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from atlas_tracking.integrations.lightning import AtlasCallback
    from atlas_tracking.testing.lightning_lm import MoELM

    warnings.filterwarnings("ignore")

    class ShardedMoELM(MoELM):
        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    c = canary(SHARDED_WINDOWS)
    trainer = pl.Trainer(
        max_steps=1, logger=False, default_root_dir=root, accelerator="cpu", devices=world,
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        callbacks=[AtlasCallback(canary=c, config=CFG)], enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(ShardedMoELM(qwen3_moe(), aux_coef=0.0), torch.utils.data.DataLoader(torch.from_numpy(c.windows),
                                                                                     batch_size=2))
    return json.loads(Path(root, "atlas", "receipts", "step_00000000.json").read_text()) if rank == 0 else None


def lightning_reference() -> dict[str, Any]:
    """The unsharded ``MoELM`` measured in this process as ``AtlasCallback`` measures it."""
    from atlas_tracking.engine.measure import default_forward
    from atlas_tracking.testing.lightning_lm import MoELM

    module = MoELM(qwen3_moe(), aux_coef=0.0)
    report = measure(module, canary(SHARDED_WINDOWS), config=CFG,
                     forward=lambda _m, ids: default_forward(module.model, ids))
    return json.loads(report.to_json())


def gate_stderr(rank: int, world: int) -> str:
    """What one gate with canary progress on prints to stderr on this rank (a gloo worker of ``run_workers``)."""
    import io
    import sys
    import tempfile

    from atlas_tracking.gate import AtlasGate

    box = [tempfile.mkdtemp() if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)  # one run directory (rank zero writes it)
    gate = AtlasGate(qwen3_moe(), canary(n_windows=8), {"receipts": {"progress": True, "batch_windows": 1,
                                                                      "n_bootstrap": 50, "anchors": 16}},
                     out_dir=box[0])
    captured, sys.stderr = sys.stderr, io.StringIO()
    try:
        gate.run(0, loss=1.0)
        return sys.stderr.getvalue()
    finally:
        sys.stderr = captured
