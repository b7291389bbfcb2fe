"""The world-size contract: every rank makes the same forward calls whatever its share of the canary, and
receipts agree across world sizes within the stated tolerances (never bit for bit across layouts).

3 processes on a 16-window canary in micro-batches of 5 windows: 4 micro-batches (the last one 1 window,
padded to 5), so ranks 1 and 2 make a filler call and rank 0 a padded one, over DeepSpeed MoE layers with
ep_size=3: the first drops tokens beyond a capacity sized by each rank's own tokens (its all_to_all needs the
same token count on every rank), the second does not drop and sizes the capacity by an all_reduce inside
its router (every call of the router is a collective). Fields are evaluated 7 tokens per call, so in the
padded call rank 0 needs fewer exchange calls than the others and makes empty ones.

Top-1 DeepSpeed MoE with random token selection drops the same tokens on 1, 2 and 4 processes, and a family with
zero-computation experts (LongCat-Flash) measures the same on 1 and 2 processes.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

import atlas_tracking.testing.parallel_models as pm
from atlas_tracking import Canary, measure
from atlas_tracking.engine.measure import micro_batches
from atlas_tracking.testing.distributed import run_workers
from atlas_tracking.testing.tolerance import assert_within_tolerance


def test_every_rank_makes_the_same_forward_calls():
    canary = Canary.from_token_ids(list(range(2000)), window=16, n_windows=16, seed=0)
    for world in (1, 2, 3, 4, 5, 7, 16, 20):
        for bw in (1, 2, 3, 5, 8, 16, 32):
            plans = [micro_batches(canary, r, world, bw) for r in range(world)]
            assert len({len(p) for p in plans}) == 1  # same number of calls on every rank
            assert {b.size for p in plans for b in p} == {min(bw, 16)}  # same shape in every call
            kept = sorted((b.start, b.end) for p in plans for b in p if b.keep)
            assert kept == canary.batches(min(bw, 16))  # every window measured once, whatever the world size


def _padded_vs_unpadded(model) -> None:
    """5 windows in micro-batches of 2 (the last one padded) against micro-batches of 1 (no padding)."""
    c = pm.canary(5)
    padded, single = (json.loads(measure(model, c, config=pm.config(bw)).to_json()) for bw in (2, 1))
    assert_within_tolerance(single, padded)


def test_padded_micro_batch_measures_only_its_windows_batch_first():
    """transformers Qwen3-MoE: batch-first, fields inside the experts' forward (padding rows get zero output)."""
    _padded_vs_unpadded(pm.qwen3_moe())


def test_padded_micro_batch_measures_only_its_windows_sequence_first():
    """Megatron-Core MoELayer on one CPU rank: sequence-first hidden states, padding windows interleaved."""
    pytest.importorskip("megatron.core")
    from atlas_tracking.testing.megatron_cpu import megatron_on_one_cpu_rank

    with megatron_on_one_cpu_rank():
        _padded_vs_unpadded(pm.megatron_stack())


@pytest.mark.slow
def test_three_processes_on_sixteen_windows_agree_with_one_process():
    pytest.importorskip("deepspeed")
    drop = (True, False)
    workers = run_workers(pm.ds_expert_parallel, 3, 6, 16, 5, 7, drop, timeout=400)
    ref0, ref1 = pm.reference(lambda perturb: pm.ds_moe(perturb=perturb, experts=6, drop_tokens=drop), n_windows=16,
                              batch_windows=5, token_chunk=7)
    assert workers[0]["gate0"] == workers[1]["gate0"] == workers[2]["gate0"]
    assert_within_tolerance(ref0, workers[0]["gate0"])
    assert_within_tolerance(ref1, workers[0]["gate1"])


@functools.cache
def _top1_reference() -> tuple[dict, dict]:
    return pm.reference(lambda perturb: pm.ds_moe(perturb=perturb, k=1))


@pytest.mark.slow
@pytest.mark.parametrize(("world", "ep_size"), [(2, 1), (2, 2), (4, 4)])
def test_top1_random_token_selection_drops_the_same_tokens_at_every_world_size(world, ep_size):
    """DeepSpeed MoE at top-1 with its default random token selection and an evaluation capacity that drops tokens
    (32 tokens a micro-batch over 8 experts, capacity factor 1), data parallel (ep_size=1) and expert parallel,
    against one process: the tokens over capacity are ranked by a draw seeded per micro-batch and layer
    (docs/distributed.md#random-routing), so the same tokens are dropped and every receipt agrees."""
    pytest.importorskip("deepspeed")
    workers = run_workers(pm.ds_expert_parallel, world, 8, 8, 2, None, (True, True), 1, ep_size)
    for ref, gate in zip(_top1_reference(), (workers[0]["gate0"], workers[0]["gate1"])):
        assert_within_tolerance(ref, gate)
        for one, many in zip(ref["per_window"]["layers"], gate["per_window"]["layers"]):
            assert one["dropped_routes"] == many["dropped_routes"]
        assert all(layer["receipts"]["dropped_routes"] > 0 for layer in gate["layers"])
        assert all(layer["receipts"]["c2"] is None for layer in gate["layers"])  # no co-active pairs at k = 1


@pytest.mark.slow
def test_zero_expert_family_on_two_processes_agrees_with_one_process():
    """LongCat-Flash (8 routed experts and 2 zero-computation ones, top-2; 2 layers), replicated on 2 processes."""
    pytest.importorskip("transformers.models.longcat_flash")
    keys = {"num_layers": 2}
    workers = run_workers(pm.family_replicated, 2, "longcat_flash", keys)
    ref = pm.family_replicated(0, 1, "longcat_flash", keys)
    for name in ("gate0", "gate1"):
        assert workers[0][name] == workers[1][name]
        assert_within_tolerance(ref[name], workers[0][name])
    for layer in ref["gate0"]["per_window"]["layers"]:
        load = np.asarray(layer["load"]).sum(0)
        assert len(load) == 10 and load[8:].sum() > 0  # tokens routed to the zero-computation slots
