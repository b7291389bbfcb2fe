"""A gloo worker of ``run_workers`` whose rank 1 stops (SIGSTOP) or exits inside a gate's canary forward.

Every rank runs the step-0 baseline and a gate at step 10 through :class:`~atlas_tracking.callbacks.ValidationGates`
(the failure path a framework's callback takes) with ``gate.collective_timeout_s`` = ``timeout_s``; rank 1 stops
itself, or exits (rank zero's forward then takes a second longer, so that rank 1 is gone before rank zero reaches
the next collective), in the first canary forward of gate 10, and every rank then tries gate 20. Rank zero returns the
seconds each of gates 10 and 20 took, what they returned and the lines of ``errors.jsonl``; then it wakes a stopped
rank 1 (SIGCONT), which finishes its own failed gates and returns the same.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from atlas_tracking.callbacks import ValidationGates
from atlas_tracking.engine.measure import default_forward
from atlas_tracking.gate import AtlasGate
from atlas_tracking.testing import parallel_models as pm


def gate_with_a_lost_rank(rank: int, world: int, how: str, timeout_s: float) -> dict[str, Any]:
    box = [tempfile.mkdtemp() if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    pids: list[Any] = [None] * world
    torch.distributed.all_gather_object(pids, os.getpid())
    armed = [False]

    def forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor | None:
        if armed[0]:
            armed[0] = False
            if rank == 1 and how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif rank == 1:
                os._exit(0)
            elif how == "exit":  # rank 1 is gone before rank zero reaches the next collective: gloo names no rank
                time.sleep(1.0)
        return default_forward(model, ids)

    config = {"receipts": {"progress": False, "batch_windows": 2, "n_bootstrap": 50, "anchors": 16},
              "gate": {"collective_timeout_s": timeout_s}}
    gates = ValidationGates(AtlasGate(pm.qwen3_moe(), pm.canary(8), config, out_dir=box[0], forward=forward),
                            warn=lambda message: None)
    first = gates.start(step=0)
    armed[0] = True
    t0 = time.perf_counter()
    second = gates.run(10, 3.0)
    seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    third = gates.run(20, 2.9)  # the side group did not survive: named again at once
    again = time.perf_counter() - t0
    errors = Path(box[0], "errors.jsonl")
    lines = [json.loads(line) for line in errors.read_text().splitlines()] if errors.exists() else []
    if rank == 0 and how == "stop":
        os.kill(pids[1], signal.SIGCONT)
    return {"first": first["status"] if first else None, "second": second, "seconds": seconds, "third": third,
            "again": again, "errors": lines}
