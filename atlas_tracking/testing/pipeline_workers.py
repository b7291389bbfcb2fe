"""Pipeline parallelism of 2 stages on CPU: torchtitan's DeepSeek-V3 cut by torchtitan's own
``pipeline_module_split`` and trained by a ``torch.distributed.pipelining`` schedule on gloo processes, with an
:class:`~atlas_tracking.gate.AtlasGate`'s training-batch telemetry on each stage and the test's own counting
hooks beside it.

The whole model is built alike on every process (``torchtitan_cpu.deepseek_v3``: layer 0 dense, layers 1 and 2
routed); stage 0 keeps ``tok_embeddings`` and layers 0-1, stage 1 layer 2, ``norm`` and ``output``. With
``checkpoint`` every stage's blocks are wrapped by torchtitan's full activation checkpointing, so the schedule's
backward runs each block's forward again. A stage cannot run a canary (stage 1 reads hidden states, not token
ids), so no gate runs: ``AtlasGate.step`` closes the intervals and rank zero writes ``load.jsonl``.

The reference hooks are the test's own: forward hooks on every ``TokenChoiceTopKRouter`` of the stage, named by
the whole model's layer whose router has the same initial gate weights, that count with plain loops over the
router's selected experts, only while the schedule runs a micro-batch's forward (``forward_maybe_with_nosync``);
they also count every router call, to show that recomputation and the stage's shape-finding forward happened.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

SPLIT = [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "norm", "output"]]
"""The module names of each stage (torchtitan's ``module_names_per_stage``)."""
BATCH, SEQ, MICRO, VOCAB = 8, 16, 4, 64


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token ids and labels of one optimizer step (the same on every process)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _routers(module: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in module.modules() if type(m).__name__ == "TokenChoiceTopKRouter"]


def routed_layer_numbers() -> dict[int, int]:
    """The whole model's layers that hold a router, each with the stage that holds it (from :data:`SPLIT`)."""
    from atlas_tracking.testing.torchtitan_cpu import deepseek_v3

    stage_of = {int(name.split(".")[1]): i for i, names in enumerate(SPLIT) for name in names if "." in name}
    return {int(name): stage_of[int(name)] for name, block in deepseek_v3().layers.items() if _routers(block)}


class ReferenceHooks:
    """The test's own per-expert counts of one stage's routers, in plain Python."""

    def __init__(self, stage: Any, part: torch.nn.Module, whole: torch.nn.Module):
        numbers = {}
        for name, block in whole.layers.items():  # the whole model's layer of each router, by its initial weights
            for router in _routers(block):
                numbers[int(name)] = router.gate.weight.detach().clone()
        self.step: dict[int, Counter] = {}
        self.seen: Counter = Counter()
        """Every router call, counted or not (a recomputation, the stage's shape-finding forward)."""
        self.in_micro_batch = False
        for router in _routers(part):
            layer = [n for n, w in numbers.items() if torch.equal(w, router.gate.weight)]
            assert len(layer) == 1, layer
            router.register_forward_hook(self._hook(layer[0]))
        forward = stage.forward_maybe_with_nosync

        def micro_batch(*args, **kwargs):
            self.in_micro_batch = True
            try:
                return forward(*args, **kwargs)
            finally:
                self.in_micro_batch = False

        stage.forward_maybe_with_nosync = micro_batch

    def _hook(self, layer: int):
        def hook(module, args, output):
            self.seen[layer] += 1
            if not self.in_micro_batch:
                return
            counts = self.step.setdefault(layer, Counter())
            for row in output[1].tolist():  # the selected experts of each token
                for expert in row:
                    counts[f"e{expert}"] += 1
                counts["tokens"] += 1
            counts["calls"] += 1
        return hook

    def take(self) -> dict[str, dict[str, int]]:
        """This step's counts per layer number, then afresh."""
        out = {str(layer): dict(counts) for layer, counts in self.step.items()}
        self.step = {}
        return out


def pipeline_telemetry(rank: int, world: int, out: str, steps: int = 3, every: int = 2,
                       checkpoint: bool = True) -> dict[str, Any]:
    """Train the 2-stage pipeline (1F1B) ``steps`` optimizer steps of ``MICRO`` micro-batches each, with telemetry every
    ``every`` steps written under ``out``; this process's stage layers and reference counts per step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.distributed.pipeline_parallel import pipeline_module_split

    from atlas_tracking import Canary
    from atlas_tracking.adapters import find_routed_layers
    from atlas_tracking.gate import AtlasGate
    from atlas_tracking.testing.torchtitan_cpu import cpu_histc_for_expert_counts, deepseek_v3

    assert world == len(SPLIT)
    with cpu_histc_for_expert_counts():
        whole = deepseek_v3()
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
        stages, parts = pipeline_module_split(whole, mesh, "1F1B", torch.device("cpu"), SPLIT)
        stage, part = stages[0], parts[0].train()
        reference = ReferenceHooks(stage, part, whole)
        if checkpoint:
            apply_ac(part, ActivationCheckpoint(mode="full"))
        layers = find_routed_layers(part)
        canary = Canary.from_token_ids(np.arange(4000) % VOCAB, window=SEQ, n_windows=4, seed=0)
        gate = AtlasGate(part, canary, {"receipts": {"progress": False},
                                        "telemetry": {"every_n_steps": every, "early_gate": False}},
                         out_dir=out, layers=layers)
        pipe = Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=cross_entropy_loss, scale_grads=False)
        optimizer = torch.optim.AdamW(part.parameters(), lr=1e-2)
        per_step = []
        for step in range(1, steps + 1):
            ids, labels = batch(step)
            optimizer.zero_grad()
            if stage.is_first:
                pipe.step(ids)
            else:
                pipe.step(target=labels, losses=[])
            optimizer.step()
            per_step.append(reference.take())
            gate.step(step)
        gate.finish()
    return {"layers": [layer.index for layer in layers], "names": [layer.name for layer in layers],
            "reference": per_step, "seen": {str(k): v for k, v in reference.seen.items()},
            "load": str(Path(gate.run_dir.path) / "load.jsonl")}
