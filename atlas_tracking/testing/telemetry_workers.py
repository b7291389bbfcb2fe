"""Gloo workers that train a few steps under an :class:`~atlas_tracking.gate.AtlasGate` with telemetry on, and
count the routes themselves: what ``load.jsonl`` must hold, summed over the processes, without the code under test.

:class:`RouteTally` puts the test's own forward hooks on routers it is handed (found by attribute path, not by the
adapters) and counts, with plain Python loops over the router's output, the routes of every forward the training
loop marks (:meth:`RouteTally.training`; the router must then be in training mode), per optimizer step. Two
readers of a router's output:

- :func:`hf_routes`: a transformers router's top-k index (``output[2]``, ``[tokens, k]``);
- :func:`deepspeed_routes`: a DeepSpeed ``TopKGate``'s sparse routes: ``exp_counts`` (``output[6]``), which
  ``top1gating``, ``top2gating`` and ``topkgating`` in ``deepspeed/moe/sharded_moe.py`` all sum from the
  routing mask *before* the capacity limit trims it (every route the router chose, dropped ones included), and
  the indices ``[k, tokens]`` (``output[3]``) where a route the capacity limit dropped is ``-1`` (the kept ones).

:func:`data_parallel` (a transformers Qwen3-MoE under DDP, any world size, gradient accumulation) and
:func:`expert_parallel` (DeepSpeed-MoE with ``ep_size = world`` and a capacity limit, under
``deepspeed.initialize``) return, per process, the tally per optimizer step, which processes wrote
``load.jsonl`` and, on rank zero, the tracker metrics a ``log_metrics`` logger received.

Example (one process, no group):
    >>> import torch
    >>> from atlas_tracking.testing.parallel_models import qwen3_moe
    >>> model = qwen3_moe().train()
    >>> tally = RouteTally([block.mlp.gate for block in model.model.layers], hf_routes)
    >>> with tally.training():
    ...     _ = model(torch.randint(0, 64, (2, 8)))
    >>> _ = model(torch.randint(0, 64, (2, 8)))        # not marked by the loop: not counted
    >>> tally.end_step(1)
    >>> [(sum(layer["load"]), layer["tokens"], layer["calls"]) for layer in tally.steps[0]]
    [(32, 16, 1), (32, 16, 1)]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from atlas_tracking.schema.artifacts import LOAD
from atlas_tracking.sinks.metrics_logger import LogMetricsSink
from atlas_tracking.testing.tiny import random_canary

TELEMETRY = {"receipts": {"progress": False, "n_bootstrap": 100, "anchors": 32}, "telemetry": {"every_n_steps": 2}}
"""A cheap gate, and an interval every 2 optimizer steps."""

Reader = Callable[[torch.nn.Module, tuple, Any], dict[str, Any]]


def hf_routes(module: torch.nn.Module, args: tuple, output: Any) -> dict[str, Any]:
    """A transformers router's call: ``load`` per expert from its top-k index, and ``tokens``."""
    load = [0] * int(module.num_experts)
    rows = output[2].reshape(-1, output[2].shape[-1]).tolist()
    for row in rows:
        for expert in row:
            load[expert] += 1
    return {"load": load, "tokens": len(rows)}


def deepspeed_routes(module: torch.nn.Module, args: tuple, output: Any) -> dict[str, Any]:
    """A DeepSpeed ``TopKGate`` call (sparse routes): ``load`` per expert (``exp_counts``: the choice before the
    capacity limit), ``kept`` per expert (the indices that are not ``-1``), ``dropped`` (routes chosen but not
    kept), ``tokens``; and ``pre_capacity``: whether ``exp_counts`` equals the top-k of the gate's own logits
    recomputed here (top-1 and top-k > 2, whose choice is deterministic; top-2 samples its second expert in
    training: its first choices, where kept, are checked against the argmax instead)."""
    k, experts = int(module.k), int(output[2])
    indices, counts = output[3].tolist(), output[6].tolist()
    tokens = len(indices[0])
    kept = [0] * experts
    for routes in indices:
        for expert in routes:
            if expert >= 0:
                kept[expert] += 1
    logits = F.linear(args[0].float(), module.wg.weight.float()).tolist()
    order = [sorted(range(experts), key=lambda e, row=row: -row[e]) for row in logits]
    if k == 2:
        pre_capacity = all(first < 0 or first == ranked[0] for first, ranked in zip(indices[0], order))
    else:
        top = [0] * experts
        for ranked in order:
            for expert in ranked[:k]:
                top[expert] += 1
        pre_capacity = top == counts
    return {"load": counts, "kept": kept, "dropped": k * tokens - sum(kept), "tokens": tokens,
            "routes": k * tokens, "pre_capacity": pre_capacity}


class RouteTally:
    """The test's own count of the routes of every marked training forward, per router and optimizer step."""

    def __init__(self, routers: list[torch.nn.Module], read: Reader):
        self.read = read
        self.on = False
        self.current: list[dict[str, Any]] = [{} for _ in routers]
        self.steps: list[list[dict[str, Any]]] = []
        """Per optimizer step (in order), per router: the sums of :attr:`read`'s fields and ``calls``."""
        self.handles = [router.register_forward_hook(self._hook(i)) for i, router in enumerate(routers)]

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """The loop's training forwards: every router call inside is counted (and must be in training mode)."""
        self.on = True
        try:
            yield
        finally:
            self.on = False

    def _hook(self, i: int):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if not self.on or torch._C._current_graph_task_id() != -1:
                return
            assert module.training, "a marked training forward ran a router in evaluation mode"
            sums = self.current[i]
            for key, value in self.read(module, args, output).items():
                if isinstance(value, list):
                    sums[key] = [a + b for a, b in zip(sums.get(key, [0] * len(value)), value)]
                elif isinstance(value, bool):
                    sums[key] = sums.get(key, True) and value
                else:
                    sums[key] = sums.get(key, 0) + value
            sums["calls"] = sums.get("calls", 0) + 1
        return hook

    def end_step(self, step: int) -> None:
        assert step == len(self.steps) + 1, "optimizer steps are numbered from 1, one at a time"
        self.steps.append(self.current)
        self.current = [{} for _ in self.current]


class Recorder:
    """A ``log_metrics`` logger that keeps what it receives (the tracker metrics, as a Lightning logger would)."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((int(step or 0), dict(metrics)))


@contextlib.contextmanager
def writes_of_load(rank: int) -> Iterator[list[list[int]]]:
    """``[rank, first_step, step]`` of every ``load.jsonl`` append this process makes (the real append, watched)."""
    import atlas_tracking.sinks.held as held

    calls: list[list[int]] = []
    append = held.append_line

    def watched(path: Any, line: dict[str, Any]) -> None:
        if Path(path).name == LOAD:
            calls.append([rank, int(line["first_step"]), int(line["step"])])
        append(path, line)

    held.append_line = watched
    try:
        yield calls
    finally:
        held.append_line = append


def _ids(rank: int, step: int, micro: int, batch: int, seq: int = 16) -> torch.Tensor:
    """A micro-batch of its own on every process, step and micro-batch."""
    generator = torch.Generator().manual_seed(100_000 * rank + 100 * step + micro)
    return torch.randint(0, 64, (batch, seq), generator=generator)


def _gate(model: torch.nn.Module, out_dir: str, recorder: Recorder, layers: list | None = None):
    from atlas_tracking.gate import AtlasGate

    return AtlasGate(model, random_canary(), TELEMETRY, out_dir=out_dir, sinks=[LogMetricsSink(recorder)],
                     layers=layers)


def _result(rank: int, tally: RouteTally, writes: list, recorder: Recorder) -> dict[str, Any]:
    train = [[step, m] for step, m in recorder.logged if any(key.startswith("atlas/train/") for key in m)]
    return {"steps": tally.steps, "writes": writes, "train_metrics": train if rank == 0 else []}


def data_parallel(rank: int, world: int, out_dir: str, steps: int, accumulate: int,
                  gate_at: int | None = None) -> dict[str, Any]:
    """parallel_models.qwen3_moe (2 routed layers, 8 experts, top-2) under DDP: the start gate, then ``steps``
    optimizer steps of ``accumulate`` micro-batches each (process ``r`` sees ``1 + r`` sequences of 16 tokens of
    its own), a gate at step ``gate_at``, ``gate.step`` after every optimizer step and ``gate.finish``."""
    from torch.nn.parallel import DistributedDataParallel

    from atlas_tracking.testing.parallel_models import qwen3_moe

    model = qwen3_moe()
    tally = RouteTally([block.mlp.gate for block in model.model.layers], hf_routes)
    recorder = Recorder()
    gate = _gate(model, out_dir, recorder)
    with writes_of_load(rank) as writes:
        gate.run(0)
        ddp = DistributedDataParallel(model.train())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(1, steps + 1):
            for micro in range(accumulate):
                ids = _ids(rank, step, micro, 1 + rank)
                sync = contextlib.nullcontext() if micro == accumulate - 1 else ddp.no_sync()
                with sync:
                    with tally.training():
                        loss = ddp(input_ids=ids, labels=ids).loss / accumulate
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            tally.end_step(step)
            if step == gate_at:
                gate.run(step)
            gate.step(step)
        gate.finish()
    return _result(rank, tally, writes, recorder)


def expert_parallel(rank: int, world: int, out_dir: str, steps: int, capacity_factor: float,
                    ks: tuple[int, ...] = (1, 2, 3)) -> dict[str, Any]:
    """A TinyDSLM of one DeepSpeed-MoE layer per ``k`` in ``ks`` (8 experts, ``ep_size = world``, drop_tokens
    with ``capacity_factor``) under ``deepspeed.initialize`` with gradient accumulation 2: the start gate, then
    ``steps`` optimizer steps of 2 micro-batches of 2 sequences of 16 tokens of its own per process,
    ``gate.step`` after every optimizer step and ``gate.finish``."""
    import deepspeed
    from torch import nn

    from atlas_tracking.integrations.deepspeed import deepspeed_layers
    from atlas_tracking.testing.deepspeed_lm import Block, TinyDSLM
    from atlas_tracking.testing.parallel_models import ds_global_name, fill_

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    model = TinyDSLM(vocab=64, d=16, layers=0, experts=8)
    model.blocks = nn.ModuleList([Block(16, 8, k, ep_size=world, capacity_factor=capacity_factor) for k in ks])
    fill_(model, ds_global_name(world, rank, 8))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_batch_size": 2 * world, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}})
    tally = RouteTally([block.moe.deepspeed_moe.gate for block in engine.module.blocks], deepspeed_routes)
    recorder = Recorder()
    gate = _gate(engine.module, out_dir, recorder, layers=deepspeed_layers(engine))
    with writes_of_load(rank) as writes:
        gate.run(0)
        engine.train()
        for step in range(1, steps + 1):
            for micro in range(2):
                ids = _ids(rank, step, micro, 2)
                with tally.training():
                    logits = engine(ids)
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))
                engine.backward(loss)
                engine.step()
            assert engine.global_steps == step  # one optimizer step per two micro-batches
            tally.end_step(step)
            gate.step(step)
        gate.finish()
    return _result(rank, tally, writes, recorder)
