"""Pipeline parallelism of 2 stages on CPU: the training-batch routing covers every routed layer of the whole model
exactly once, labelled with the model's own layer numbers, and equals the test's own hook counts.

torchtitan's DeepSeek-V3 (layer 0 dense, layers 1 and 2 routed) is cut by torchtitan's ``pipeline_module_split``
and trained by ``torch.distributed.pipelining``'s 1F1B schedule on 2 gloo processes, 4 micro-batches a step,
with torchtitan's full activation checkpointing on both stages (``atlas_tracking.testing.pipeline_workers``).
Megatron-Core's pipeline schedules need CUDA (``p2p_communication`` allocates its receive buffers on
``torch.cuda.current_device()``, ``forward_backward_pipelining_without_interleaving`` its token count with
``device="cuda"``), so its pipeline is not run here. Costs about 10 s (two spawned processes).
"""

from __future__ import annotations

import pytest

from atlas_tracking.artifacts.load_record import read_load
from atlas_tracking.testing.distributed import run_workers

pytest.importorskip("torchtitan.distributed.pipeline_parallel")
from atlas_tracking.testing import pipeline_workers as pw

STEPS, EVERY = 3, 2


def _sum(per_step: list[dict[str, dict[str, int]]], steps: range) -> dict[str, dict[str, int]]:
    total: dict[str, dict[str, int]] = {}
    for step in steps:
        for layer, counts in per_step[step - 1].items():
            into = total.setdefault(layer, {})
            for key, value in counts.items():
                into[key] = into.get(key, 0) + value
    return total


def test_two_stage_pipeline_counts_every_layer_once_with_its_own_number(tmp_path):
    workers = run_workers(pw.pipeline_telemetry, 2, str(tmp_path / "atlas"), STEPS, EVERY, timeout=240)
    routed = pw.routed_layer_numbers()  # whole model's routed layer -> the stage holding it
    assert routed == {1: 0, 2: 1}
    for stage, worker in enumerate(workers):  # each stage counts its own layers, under the model's numbers
        assert worker["layers"] == [layer for layer, held in routed.items() if held == stage]
        # the routers also ran in every micro-batch's recomputation and in the stage's shape-finding forward (and,
        # on the last stage, that forward's recomputation): none of these is counted
        assert all(worker["seen"][str(layer)] >= 2 * STEPS * pw.MICRO + 1 for layer in worker["layers"])

    lines = read_load(workers[0]["load"])  # written by rank 0, stage 1's layer included
    assert [(line["first_step"], line["step"]) for line in lines] == [(1, 2), (3, 3)]
    for line in lines:
        steps = range(line["first_step"], line["step"] + 1)
        assert [row["layer"] for row in line["layers"]] == sorted(routed)  # each layer once, in the model's order
        assert line["tokens"] == len(steps) * pw.BATCH * pw.SEQ
        for row in line["layers"]:
            holder = workers[routed[row["layer"]]]
            ref = _sum(holder["reference"], steps)[str(row["layer"])]
            assert row["name"] == holder["names"][holder["layers"].index(row["layer"])]
            assert row["processes"] == 1  # the one process of its stage
            assert row["load"] == [ref.get(f"e{e}", 0) for e in range(8)]  # exact, every micro-batch once
            assert row["tokens"] == ref["tokens"] == len(steps) * pw.BATCH * pw.SEQ
            assert row["calls"] == ref["calls"] == len(steps) * pw.MICRO
            assert sum(row["load"]) == 2 * row["tokens"] and row["dropped"] is None  # top-2, nothing dropped
