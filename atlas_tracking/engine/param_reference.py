"""The parameters at the atlas baseline, kept on the host, and the parameter drift of a gate against them.

:class:`ParamReference` copies each parameter this process holds to host (CPU) memory when the atlas
baseline is taken (:meth:`~ParamReference.take`) and, at a later gate, sums per module group how far the
parameters moved (:meth:`~ParamReference.measure`, :mod:`atlas_tracking.receipts.param_drift`). The copy
costs host memory equal to the local parameters' size in their own dtype, one copy per shard: a process keeps
only what it holds (its ZeRO-3 partition, its FSDP2 shard, its expert-parallel experts), and parameters that
are the same on every process (data-parallel replicas) only the first process keeps. Above ``budget_bytes``
per process every n-th element is kept and the drift is an estimate (``form``); nothing is written to disk.
A run resumed from a checkpoint starts a new atlas baseline, and the parameter reference with it.

Groups (:func:`param_groups`): the parameters of the routed layers' own ``router`` and ``experts`` modules,
as the family adapters found them (so a custom model's router is classified by its adapter, whatever its
name), then by module type and name: norms (a ``*Norm*`` module, or ``norm`` / ``ln_`` in the name, which
also takes Megatron's ``layer_norm_weight`` fused into a linear), embeddings and the LM head
(``nn.Embedding``, ``embed*``, ``wte``, ``lm_head``, ``word_embeddings``, ``output_layer``, a top-level
``output``), attention (``attn`` / ``attention`` in the name), then router and experts by name for MoE
blocks no adapter recognised (``router``, ``gate`` / ``wg`` under an MoE block, ``experts``), and ``other``
(dense MLPs, shared experts, SSM mixers). Tied weights are counted once.

Local shards: a replicated parameter (plain tensor: one process, DDP) is summed on this process alone;
a ZeRO-3 partition (``ds_tensor``, its padding left out) is summed over its partition group; an FSDP2
DTensor's local shard (``to_local()``) over the mesh dimensions it is sharded on; an expert-parallel
layer's experts (DeepSpeed MoE, Megatron, AutoEP) over the layer's expert-parallel group. Measuring is
collective when any parameter is sharded (call it on every process).

Example:
    >>> import torch
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> from atlas_tracking.adapters import find_routed_layers
    >>> _ = torch.manual_seed(0)
    >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ...     head_dim=8, num_experts=8, num_experts_per_tok=2))
    >>> ref = ParamReference()
    >>> ref.take(model, find_routed_layers(model))
    >>> with torch.no_grad():
    ...     model.model.layers[0].mlp.gate.weight[0, 0] += 1.0
    >>> drift = ref.measure(model)
    >>> drift["groups"]["router"]["moved"], drift["groups"]["experts"]["moved"], drift["total"]["moved"]
    (1, 0, 1)
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from atlas_tracking.adapters.base import RoutedLayer
from atlas_tracking.engine.collectives import checkpoint
from atlas_tracking.receipts.param_drift import GROUPS, summarize, tensor_sums

EMBEDDING_PARTS = {"embed_tokens", "wte", "wpe", "lm_head", "word_embeddings", "position_embeddings",
                   "tok_embeddings", "output_layer", "embed_in", "embed_out", "embeddings", "embedding"}
MOE_PARTS = {"mlp", "moe", "block_sparse_moe", "deepspeed_moe", "feed_forward", "mixer"}


class ParamDriftError(ValueError):
    """The parameters no longer match the reference kept at the baseline (names or sizes changed)."""


def group_by_name(name: str) -> str:
    """The group of a parameter from its dotted name alone (module types and adapters come first in
    :func:`param_groups`).

    >>> [group_by_name(n) for n in ("model.layers.0.self_attn.q_norm.weight", "model.embed_tokens.weight",
    ...  "lm_head.weight", "model.layers.0.self_attn.q_proj.weight", "layers.0.mlp.router.weight",
    ...  "l.0.deepspeed_moe.gate.wg.weight", "model.layers.0.mlp.experts.gate_up_proj",
    ...  "model.layers.0.mlp.shared_experts.up_proj.weight", "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
    ...  "output.weight")]
    ['norms', 'embeddings', 'embeddings', 'attention', 'router', 'router', 'experts', 'other', 'norms', 'embeddings']
    """
    parts = name.split(".")
    modules = parts[:-1]
    if any("norm" in p or p.startswith("ln_") or p == "ln" for p in parts):
        return "norms"
    if any(p in EMBEDDING_PARTS or p.startswith("embed") for p in modules) or modules == ["output"]:
        return "embeddings"
    if any("attn" in p or "attention" in p for p in modules):
        return "attention"
    if "router" in modules or any(p in ("gate", "wg") and i > 0 and modules[i - 1] in MOE_PARTS
                                  for i, p in enumerate(modules)):
        return "router"
    if any(p in ("experts", "local_experts", "deepspeed_experts") for p in modules):
        return "experts"
    return "other"


def _is_norm(module: nn.Module) -> bool:
    return "Norm" in type(module).__name__


def named_unique_parameters(model: nn.Module) -> Iterable[tuple[str, nn.Module, nn.Parameter]]:
    """``(name, owning module, parameter)`` once per parameter (a tied weight under its first name)."""
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            yield (f"{prefix}.{leaf}" if prefix else leaf), module, p


def param_groups(model: nn.Module, layers: Iterable[RoutedLayer] = ()) -> dict[str, str]:
    """Parameter name -> group (:data:`~atlas_tracking.receipts.param_drift.GROUPS`), every parameter once.

    The routed ``layers`` (from :func:`~atlas_tracking.adapters.base.find_routed_layers`) decide the router
    and experts of the blocks they cover; their norms and other modules go by type and name.
    """
    by_id: dict[int, str] = {}
    for layer in layers:
        for p in layer.experts.parameters():
            by_id[id(p)] = "experts"
        if layer.router is not layer.block:
            for p in layer.router.parameters():
                by_id.setdefault(id(p), "router")
    out = {}
    for name, module, p in named_unique_parameters(model):
        if id(p) in by_id:
            out[name] = by_id[id(p)]
        elif _is_norm(module):
            out[name] = "norms"
        elif isinstance(module, nn.Embedding):
            out[name] = "embeddings"
        else:
            out[name] = group_by_name(name)
    return out


def _expert_groups(layers: Iterable[RoutedLayer]) -> dict[int, Any]:
    """Parameter id -> expert-parallel group, for the experts of layers spread over one."""
    out: dict[int, Any] = {}
    for layer in layers:
        placement = layer.expert_placement()
        if placement is not None:
            for p in layer.experts.parameters():
                out[id(p)] = placement[0]
    return out


def local_part(p: torch.Tensor, expert_group: Any = None) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """What this process holds of ``p`` and the process groups its sums add over (``()``: replicated, count
    once; ``None`` in the tuple: the default group).

    >>> t, groups = local_part(torch.ones(3))
    >>> t.shape, groups
    (torch.Size([3]), ())
    """
    ds = getattr(p, "ds_tensor", None)
    if ds is not None:  # ZeRO-3: this process's partition, without the padding of the last one
        group = getattr(p, "ds_process_group", None)
        rank = int(getattr(p, "ds_zero_partition_rank", torch.distributed.get_rank(group=group)))
        size = int(getattr(ds, "ds_numel", ds.numel()))
        valid = max(0, min(int(p.ds_numel) - rank * size, size))
        return ds.detach().reshape(-1)[:valid], (group,)
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor
        DTensor = ()
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        groups = tuple(mesh.get_group(i) for i, placement in enumerate(p.placements) if placement.is_shard())
        return p.to_local().detach(), groups
    return p.detach(), (() if expert_group is None else (expert_group,))


@dataclass
class _Kept:
    group: str
    reduce: tuple[Any, ...]
    ref: torch.Tensor | None
    """The kept elements on the host (every ``stride``-th from ``offset``); None: a replica another process keeps."""
    numel: int
    stride: int = 1
    offset: int = 0

    def sums(self, local: torch.Tensor) -> np.ndarray:
        """This part's four sums against the reference: exact, or scaled up from the kept elements."""
        if self.ref is None:
            return np.zeros(4)
        if self.stride == 1:
            return tensor_sums(local, self.ref)
        sample = tensor_sums(local.reshape(-1)[self.offset::self.stride], self.ref)
        scale = self.numel / max(self.ref.numel(), 1)
        return np.array([sample[0] * scale, sample[1] * scale, round(sample[2] * scale), self.numel])


def _keep(local: torch.Tensor, stride: int, seed: str) -> tuple[torch.Tensor, int]:
    """The host copy of ``local`` (every ``stride``-th element from an offset seeded by ``seed``) and the offset."""
    if stride == 1:
        return local.to("cpu", copy=True), 0
    offset = zlib.crc32(seed.encode()) % min(stride, max(local.numel(), 1))
    return local.reshape(-1)[offset::stride].to("cpu", copy=True), offset


def _replicas_and_bytes(parts: dict[str, tuple[torch.Tensor, tuple[Any, ...]]],
                        tp: set[str]) -> tuple[bool, int]:
    """Whether the plain (not sharded, not tensor-parallel) parameters are the same on every process (names,
    sizes, sum and sum of squares; then only the first process keeps them), and the most bytes a process will
    keep (one collective on the default group; ``(False, local bytes)`` in a single process)."""
    local_bytes = sum(t.numel() * t.element_size() for t, _ in parts.values())
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
            or torch.distributed.get_world_size() == 1:
        return False, local_bytes
    plain = [(n, t) for n, (t, reduce) in parts.items() if not reduce and n not in tp]
    mine = torch.tensor([float(len(plain)), float(sum(t.numel() for _, t in plain)),
                         float(zlib.crc32("\n".join(n for n, _ in plain).encode())),
                         sum(float(t.double().sum()) for _, t in plain),
                         sum(float(t.double().square().sum()) for _, t in plain),
                         float(local_bytes), float(sum(t.numel() * t.element_size() for _, t in plain))],
                        dtype=torch.float64)
    device = collective_device()
    everyone = [torch.zeros_like(mine, device=device) for _ in range(torch.distributed.get_world_size())]
    checkpoint("the parameter reference's replica check")
    torch.distributed.all_gather(everyone, mine.to(device))
    rows = torch.stack(everyone).cpu()
    replicas = bool(plain) and bool((rows[:, :5] == rows[0, :5]).all())
    others = torch.arange(len(rows)) != 0
    kept = rows[:, 5] - rows[:, 6] * (others & replicas)
    return replicas, int(kept.max())


class ParamReference:
    """A host copy of the parameters this process holds, taken at the atlas baseline (see the module doc)."""

    def __init__(self, budget_bytes: int | None = None) -> None:
        self.budget_bytes = budget_bytes
        """The most host bytes one process's copy may take (None: no bound); beyond it every ``stride``-th
        element is kept and the drift is an estimate (:attr:`form`)."""
        self.kept: dict[str, _Kept] = {}
        self.step: int | None = None
        """The step of the baseline the reference was taken at."""
        self.form: dict[str, Any] = {}
        """How the reference is kept: ``form`` (``exact`` or ``sampled``), ``stride``, ``replicas_kept_once`` and
        ``reason`` (why sampled; None when exact); the record's ``param_drift.reference``."""
        self.seconds = 0.0
        """Wall time of the last :meth:`measure` (kept out of the record: each process has its own)."""

    @property
    def ready(self) -> bool:
        return bool(self.kept)

    @property
    def host_bytes(self) -> int:
        """Host memory the reference holds on this process."""
        return sum(k.ref.numel() * k.ref.element_size() for k in self.kept.values() if k.ref is not None)

    def clear(self) -> None:
        self.kept, self.step, self.form = {}, None, {}

    def take(self, model: nn.Module, layers: Iterable[RoutedLayer] = (), step: int | None = None) -> None:
        """Copy every parameter's local part to host memory, with its group (collective in a distributed run:
        the processes compare their replicated parameters, which then only the first one keeps)."""
        layers = list(layers)
        groups = param_groups(model, layers)
        experts = _expert_groups(layers)
        params = {name: p for name, _, p in named_unique_parameters(model)}
        parts = {name: local_part(p, experts.get(id(p))) for name, p in params.items()}
        tp = {name for name, p in params.items() if getattr(p, "tensor_model_parallel", False)}
        replicas, most = _replicas_and_bytes(parts, tp)
        stride = 1 if self.budget_bytes is None or most <= self.budget_bytes else -(-most // self.budget_bytes)
        first = not replicas or torch.distributed.get_rank() == 0
        kept = {}
        for name, (local, reduce) in parts.items():
            shared = replicas and not reduce and name not in tp
            ref, offset = _keep(local, stride, name) if first or not shared else (None, 0)
            kept[name] = _Kept(groups[name], (None,) if shared else reduce, ref, local.numel(), stride, offset)
        self.kept, self.step = kept, step
        self.form = {"form": "exact" if stride == 1 else "sampled", "stride": stride,
                     "replicas_kept_once": replicas,
                     "reason": None if stride == 1 else (
                         f"the parameters a process holds take up to {most} bytes, more than "
                         f"gate.param_drift_budget_bytes {self.budget_bytes}: every {stride}-th element of each "
                         "tensor is kept and the drift is estimated from them (docs/receipts.md#parameter-drift)")}

    def measure(self, model: nn.Module) -> dict[str, Any]:
        """The parameter drift of ``model`` against the reference: per group and total (collective when any
        parameter is sharded or replicated parameters are kept once). Raises :class:`ParamDriftError` when the
        parameters no longer match it."""
        t0 = time.perf_counter()
        params = {name: p for name, _, p in named_unique_parameters(model)}
        if set(params) != set(self.kept):
            changes = [f"{what} {names[:3]}{' and more' if len(names) > 3 else ''}" for what, names in (
                ("new", sorted(set(params) - set(self.kept))), ("missing", sorted(set(self.kept) - set(params))))
                if names]
            raise ParamDriftError(f"the model's parameters differ from the reference taken at step {self.step}: "
                                  + ", ".join(changes))
        buckets: dict[tuple[Any, ...], np.ndarray] = {}
        for name, kept in self.kept.items():
            local, _ = local_part(params[name])
            if local.numel() != kept.numel:
                raise ParamDriftError(f"parameter {name} holds {local.numel()} elements here, its reference "
                                      f"{kept.numel} (taken at step {self.step})")
            sums = buckets.setdefault(kept.reduce, np.zeros((len(GROUPS), 4)))
            sums[GROUPS.index(kept.group)] += kept.sums(local)
        total = np.zeros((len(GROUPS), 4))
        for reduce, sums in buckets.items():
            total += _all_reduce(sums, reduce)
        present = {g for g in (k.group for k in self.kept.values())}
        out = summarize({g: total[i] for i, g in enumerate(GROUPS) if g in present})
        out["reference_step"] = self.step
        out["reference"] = dict(self.form)
        self.seconds = time.perf_counter() - t0
        return out


def _all_reduce(sums: np.ndarray, groups: tuple[Any, ...]) -> np.ndarray:
    """``sums`` added over each process group in turn (float64; on the backend's device)."""
    if not groups:
        return sums
    t = torch.from_numpy(sums).to(collective_device())
    checkpoint("the parameter drift's sums")
    for group in groups:
        torch.distributed.all_reduce(t, group=group)
    return t.cpu().numpy()


def collective_device() -> torch.device:
    """Where the default process group's backend takes tensors: this process's GPU for NCCL, else the CPU."""
    if "nccl" in str(torch.distributed.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
