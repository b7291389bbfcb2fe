"""Sharded parameters on 2 gloo processes: receipts equal the unsharded model's on one process, and every
parameter is sharded again after each gate.

A transformers Qwen3-MoE (8 experts, top-2) under DeepSpeed ZeRO stage 3 (every parameter partitioned)
and under FSDP2 (``fully_shard`` on each decoder layer and on the model). The canary has 3 micro-batches,
so one process makes a filler forward call: with uneven calls the ranks' parameter all-gathers diverge
(gloo: "Received data size doesn't match expected size").
"""

from __future__ import annotations

import pytest

import atlas_tracking.testing.parallel_models as pm
from atlas_tracking.testing.distributed import run_workers
from atlas_tracking.testing.tolerance import assert_within_tolerance


def _check(workers: list[dict]) -> None:
    ref0, ref1 = pm.reference(lambda perturb: pm.qwen3_moe(perturb=perturb), n_windows=pm.SHARDED_WINDOWS)
    assert workers[0]["gate0"] == workers[1]["gate0"]
    assert_within_tolerance(ref0, workers[0]["gate0"])
    assert_within_tolerance(ref1, workers[0]["gate1"])
    assert all(layer["content_drift"] > 0 for layer in workers[0]["gate1"]["drift"]["layers"])
    for w in workers:
        assert all(h < f for h, f in zip(w["held_before"], w["full"]))  # every parameter is sharded
        assert w["held_between"] == w["held_before"] and w["held_after"] == w["held_before"]


@pytest.mark.slow
def test_zero3_gates_equal_unsharded_and_leave_parameters_partitioned():
    pytest.importorskip("deepspeed")
    workers = run_workers(pm.zero3, 2)
    _check(workers)
    outside, inside, after = workers[0]["gathered"]  # the capture's guard for norm and router reads
    assert outside == after == [0, 0] and inside == [32, 8 * 32]


@pytest.mark.slow
def test_fsdp2_gates_equal_unsharded_and_leave_parameters_sharded():
    _check(run_workers(pm.fsdp2, 2))


@pytest.mark.slow
def test_lightning_model_parallel_strategy_gate_equals_unsharded(tmp_path):
    pytest.importorskip("lightning")
    workers = run_workers(pm.lightning_model_parallel, 2, str(tmp_path))
    assert_within_tolerance(pm.lightning_reference(), workers[0])
