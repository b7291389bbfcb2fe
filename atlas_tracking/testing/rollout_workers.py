"""Worker functions for the multi-process rollout-agreement test (run by :func:`~atlas_tracking.testing.distributed.
run_workers` on gloo processes): every process hands ``AtlasGate.rollout`` a batch of its own and the routes a bf16
copy of the model chose for it; the test sums the processes' own results."""

from __future__ import annotations

import copy
from typing import Any

import torch

from atlas_tracking.testing.tiny import QUIET, random_canary


def rollout_parallel(rank: int, world: int, out_dir: str, steps: int) -> dict[str, Any]:
    """parallel_models.qwen3_moe (2 routed layers, 8 experts, top-2) as the trainer and its bf16 copy as the rollout
    engine: at every step process ``r`` hands over ``2 + r`` sequences of 24 tokens of its own. Returns the batches
    and routes it handed over, and the lines ``gate.rollout`` returned."""
    from atlas_tracking.engine.rollout import trainer_routes
    from atlas_tracking.gate import AtlasGate
    from atlas_tracking.testing.parallel_models import qwen3_moe

    model = qwen3_moe(perturb=0.3)
    engine = copy.deepcopy(model).to(torch.bfloat16)
    gate = AtlasGate(model, random_canary(), QUIET, out_dir=out_dir)
    handed, lines = [], []
    for step in range(1, steps + 1):
        ids = torch.randint(0, 64, (2 + rank, 24), generator=torch.Generator().manual_seed(1000 * rank + step))
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        routes = trainer_routes(engine, ids, mask)
        handed.append({"ids": ids.tolist(), "mask": mask.tolist(), "routes": routes.tolist()})
        lines.append(gate.rollout(step, ids, routes, mask))
    gate.finish()
    return {"handed": handed, "lines": lines}
