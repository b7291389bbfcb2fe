"""Expert parallelism on 2 gloo processes: every field receipt equals the one-process receipts of the same weights.

Experts held by the other process are evaluated there, through an ``all_to_all_single`` exchange over
the layer's expert-parallel group (``atlas_tracking.engine.fields``). Each test spawns its workers once and
compares the baseline gate and a drift gate against a baseline with the one-process reference computed
here, within the tolerances of ``atlas_tracking.testing.tolerance`` (never bit for bit: the expert GEMMs see other
batch layouts).
"""

from __future__ import annotations

import numpy as np
import pytest

import atlas_tracking.testing.parallel_models as pm
from atlas_tracking.artifacts.gate_report import verify
from atlas_tracking.testing.distributed import run_workers
from atlas_tracking.testing.tolerance import assert_within_tolerance

pytest.importorskip("deepspeed")

FIELD_RECEIPTS = ("c2", "v2_c1", "v2_c2", "transition_incompat", "d_random_boundary")
DRIFT = ("coord_drift", "boundary_drift", "transition_drift", "content_drift")


def _check(one_process: tuple[dict, dict], workers: list[dict], experts: int = 8) -> None:
    ref0, ref1 = one_process
    assert workers[0]["gate0"] == workers[1]["gate0"]  # same world size, same gathered arrays: identical
    for ref, gate in ((ref0, workers[0]["gate0"]), (ref1, workers[0]["gate1"])):
        assert verify(gate) == []  # every receipt re-derives from the gathered per-window arrays
        devs = assert_within_tolerance(ref, gate)
        assert all(devs[name] <= 1e-5 for name in (*FIELD_RECEIPTS, "margin_mean", "ov_cf", "canary_nll"))
    for layer in workers[0]["gate0"]["layers"]:
        receipts = layer["receipts"]
        assert "scope" not in layer and "nonlocal_tokens" not in receipts
        assert all(receipts[name] is not None for name in FIELD_RECEIPTS)
        check = layer["selfcheck"]  # evaluated on every layer: experts held elsewhere answer over the exchange
        assert check["recombination"] is not None and check["recombination"] <= check["tolerance"], check
        load = np.asarray(layer and workers[0]["gate0"]["per_window"]["layers"][layer["ordinal"]]["load"]).sum(0)
        half = experts // 2
        assert load[:half].sum() > 0 and load[half:].sum() > 0  # tokens routed to both processes' experts
    drift = workers[0]["gate1"]["drift"]["layers"]
    assert all(layer[name] > 0 for layer in drift for name in DRIFT)  # the perturbation moved every functional


@pytest.mark.slow
def test_deepspeed_moe_ep2_equals_one_process_and_disagreeing_canaries_fail_every_rank():
    """DeepSpeed MoE, 8 experts, top-2, ep_size=2 under deepspeed.initialize on 2 processes."""
    workers = run_workers(pm.ds_expert_parallel, 2)
    _check(pm.reference(lambda perturb: pm.ds_moe(perturb=perturb)), workers)
    errors = [w["disagreement"] for w in workers]
    assert all(e is not None and "disagree on the canary" in e for e in errors) and errors[0] == errors[1]


@pytest.mark.slow
def test_deepspeed_moe_ep4_self_check_recombines_on_every_layer():
    """ep_size=4, two experts a process: most sampled tokens' experts are held elsewhere, and the self-check's
    recombination still runs on every layer, those experts answering over the field exchange."""
    workers = run_workers(pm.ds_expert_parallel, 4, timeout=400)
    _check(pm.reference(lambda perturb: pm.ds_moe(perturb=perturb)), workers)


@pytest.mark.slow
def test_autoep_ep2_equals_one_process():
    """DeepSpeed AutoEP layers replacing a transformers Qwen3-MoE (8 experts, top-2), ep_size=2 on 2 processes."""
    workers = run_workers(pm.autoep_expert_parallel, 2)
    _check(pm.reference(lambda perturb: pm.autoep(perturb=perturb)), workers)


@pytest.mark.slow
def test_megatron_moe_layer_ep2_on_cpu_equals_one_process():
    """Megatron-Core MoELayer (SequentialMLP, allgather dispatcher) with expert_model_parallel_size=2 on CPU,
    against expert_model_parallel_size=1 in one process; stand-ins named in parallel_models.megatron_on_cpu."""
    pytest.importorskip("megatron.core")
    workers = run_workers(pm.megatron_expert_parallel, 2)
    one = run_workers(pm.megatron_expert_parallel, 1)[0]
    _check((one["gate0"], one["gate1"]), workers)
