"""Training-batch route counts between gates across processes: every ``load.jsonl`` line is exactly the sum of
every process's own counts for the steps of its interval.

Each gloo worker (:mod:`atlas_tracking.testing.telemetry_workers`) trains a few optimizer steps on data of its
own under an ``AtlasGate`` with ``telemetry.every_n_steps: 2`` and counts the routes itself, with its own forward
hooks on the routers and plain Python loops over their outputs, per optimizer step. Counts of the same routes
are integers: compared exactly.

DeepSpeed's ``exp_counts`` (``deepspeed/moe/sharded_moe.py``): ``top1gating``, ``top2gating`` and ``topkgating``
each sum it from the routing mask before the capacity limit trims the mask, so it holds every route the
router chose, dropped ones included; the sparse indices mark a dropped route ``-1``. The worker checks that
reading against the gate's own logits (``pre_capacity``) before the counts are used as the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atlas_tracking.testing import telemetry_workers as tw
from atlas_tracking.testing.distributed import run_workers

EXPERTS = 8


def _lines(out_dir: Path) -> list[dict]:
    return [json.loads(text) for text in (out_dir / "load.jsonl").read_text().splitlines()]


def _own(workers: list[dict], first: int, last: int, layer: int, key: str) -> list[int] | int:
    """The sum of ``key`` over every process and the optimizer steps ``first..last`` of routed layer ``layer``."""
    zero: list[int] | int = [0] * EXPERTS if key in ("load", "kept") else 0
    total = zero
    for worker in workers:
        for step in range(first, last + 1):
            value = worker["steps"][step - 1][layer].get(key, zero)  # {} where the layer saw no call that step
            total = [a + b for a, b in zip(total, value)] if isinstance(total, list) else total + value
    return total


def _check_intervals(out_dir: Path, workers: list[dict], intervals: list[tuple[int, int]]) -> list[dict]:
    """The lines tile ``intervals``; rank zero alone wrote them, once each; every layer's ``load``, ``tokens`` and
    ``calls`` are the sums of the processes' own counts, and every process counted."""
    lines = _lines(out_dir)
    assert [(line["first_step"], line["step"]) for line in lines] == intervals
    assert [write for worker in workers for write in worker["writes"]] == [[0, *span] for span in intervals]
    layers = len(workers[0]["steps"][0])
    for line, (first, last) in zip(lines, intervals):
        assert [row["layer"] for row in line["layers"]] == list(range(layers))
        for i, row in enumerate(line["layers"]):
            assert row["load"] == _own(workers, first, last, i, "load"), (first, last, i)
            assert row["tokens"] == _own(workers, first, last, i, "tokens")
            assert row["calls"] == _own(workers, first, last, i, "calls")
            assert row["processes"] == len(workers)
        assert line["tokens"] == max(row["tokens"] for row in line["layers"])
    return lines


@pytest.mark.slow
@pytest.mark.parametrize(("world", "accumulate", "gate_at", "intervals"), [
    (2, 2, 3, [(1, 2), (3, 3), (4, 4), (5, 5)]),
    (4, 1, None, [(1, 2), (3, 4), (5, 5)]),
], ids=["2proc-accumulate2-gate3", "4proc"])
def test_data_parallel_load_is_the_sum_of_every_process_own_counts(tmp_path, world, accumulate, gate_at, intervals):
    """A transformers Qwen3-MoE (2 routed layers, 8 experts, top-2) under DDP on ``world`` processes, each on
    ``1 + rank`` sequences of its own per micro-batch. Every 2 optimizer steps an interval closes; a gate closes
    one early (no interval straddles it); ``gate.finish`` closes the last, partial one. With gradient
    accumulation both micro-batches of a step are in its counts."""
    workers = run_workers(tw.data_parallel, world, str(tmp_path), 5, accumulate, gate_at, timeout=240)
    lines = _check_intervals(tmp_path, workers, intervals)
    for worker, rank in zip(workers, range(world)):  # every micro-batch of every step was counted by the test
        assert all(layer["calls"] == accumulate and layer["tokens"] == accumulate * (1 + rank) * 16
                   for step in worker["steps"] for layer in step)
    for line, (first, last) in zip(lines, intervals):
        assert line["tokens"] == (last - first + 1) * accumulate * 16 * sum(1 + r for r in range(world))
        assert all(sum(row["load"]) == 2 * row["tokens"] and row["dropped"] is None for row in line["layers"])


@pytest.mark.slow
def test_deepspeed_expert_parallel_counts_dropped_routes_and_tokens_per_ep_rank(tmp_path):
    """DeepSpeed-MoE, ep_size=2 on 2 processes, one layer each of top-1 (random token selection), top-2 (second
    expert sampled) and top-3, capacity factor 0.5 (about half the routes dropped), gradient accumulation 2:
    ``load`` (routes chosen, dropped included), ``dropped`` and ``ep_tokens`` (per global rank, the kept routes
    to the experts it holds, summed over the senders) equal the processes' own counts; the tracker's
    ``overload_factor`` and ``dropped_fraction`` equal a plain max / mean and ratio of those counts."""
    pytest.importorskip("deepspeed")
    world, ks, steps = 2, (1, 2, 3), 3
    workers = run_workers(tw.expert_parallel, world, str(tmp_path), steps, 0.5, ks, timeout=240)
    intervals = [(1, 2), (3, 3)]
    lines = _check_intervals(tmp_path, workers, intervals)
    for worker in workers:
        for step in worker["steps"]:
            for k, layer in zip(ks, step):
                assert layer["pre_capacity"], f"top-{k}: exp_counts is not the router's choice before capacity"
                assert sum(layer["load"]) == layer["routes"] == k * layer["tokens"]
                assert all(kept <= chosen for kept, chosen in zip(layer["kept"], layer["load"]))
    held = [[e for e in range(EXPERTS) if e // (EXPERTS // world) == rank] for rank in range(world)]
    metrics = dict((step, m) for step, m in workers[0]["train_metrics"])
    for line, (first, last) in zip(lines, intervals):
        assert line["tokens"] == (last - first + 1) * 2 * 2 * 16 * world  # 2 micro-batches of 2 x 16 tokens
        overload, dropped_all, chosen_all = [], 0, 0
        for i, row in enumerate(line["layers"]):
            dropped = _own(workers, first, last, i, "dropped")
            kept = _own(workers, first, last, i, "kept")
            assert 0 < dropped < sum(row["load"]), "the capacity limit should drop some routes, not all"
            assert row["dropped"] == dropped
            received = [sum(kept[e] for e in experts) for experts in held]
            assert row["ep_ranks"] == list(range(world)) and row["ep_tokens"] == received
            assert sum(received) + dropped == sum(row["load"])
            overload.append(max(received) / (sum(received) / len(received)))
            dropped_all, chosen_all = dropped_all + dropped, chosen_all + sum(row["load"])
        logged = metrics[line["step"]]
        assert logged["atlas/train/overload_factor"] == pytest.approx(max(overload), rel=1e-12)
        assert logged["atlas/train/dropped_fraction"] == pytest.approx(dropped_all / chosen_all, rel=1e-12)
    assert all(not worker["train_metrics"] for worker in workers[1:])  # the trackers hear from rank zero only


def test_rollout_agreement_lines_sum_every_process_batch(tmp_path):
    """Each process hands ``gate.rollout`` its own batch (of a different size); the line every process returns, and
    the one rank zero wrote, hold the sums of the processes' own single-process results, and the perturbation's
    quantiles are those of every process's mismatched positions together."""
    import torch

    from atlas_tracking.testing.parallel_models import qwen3_moe
    from atlas_tracking.testing.rollout_workers import rollout_parallel

    out = tmp_path / "atlas"
    workers = run_workers(rollout_parallel, 2, str(out), 3)
    written = [json.loads(text) for text in (out / "rollout.jsonl").read_text().splitlines()]
    assert [line["step"] for line in written] == [1, 2, 3] and all(line["processes"] == 2 for line in written)
    model = qwen3_moe(perturb=0.3)
    mismatched = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' kernel order: the same batches give the same routing, bit for bit
    try:
        mismatched = _check_rollout_lines(written, workers, model)
    finally:
        torch.set_num_threads(threads)
    assert mismatched > 0


def _check_rollout_lines(written: list[dict], workers: list[dict], model) -> int:
    import numpy as np
    import torch

    from atlas_tracking import rollout_agreement
    from atlas_tracking.engine.rollout import read_agreement
    from atlas_tracking.receipts.rollout import mismatch_gaps

    mismatched = 0
    for s, line in enumerate(written):
        assert all(w["lines"][s]["layers"] == line["layers"] for w in workers)      # every process: one line
        handed = [w["handed"][s] for w in workers]
        own = [rollout_agreement(model, torch.tensor(h["ids"]), torch.tensor(h["routes"]), torch.tensor(h["mask"]))
               for h in handed]
        reads = [read_agreement(model, torch.tensor(h["ids"]), torch.tensor(h["routes"]), torch.tensor(h["mask"]))
                 for h in handed]
        for i, row in enumerate(line["layers"]):
            for key in ("tokens", "compared", "fallback", "mismatched", "routes", "routes_moved"):
                assert row[key] == sum(o["layers"][i][key] for o in own), (s, i, key)
            jaccard = sum(o["layers"][i]["jaccard"] * o["layers"][i]["compared"] for o in own) / row["compared"]
            assert row["jaccard"] == pytest.approx(jaccard, abs=1e-5)
            gaps = np.concatenate([mismatch_gaps(r.fields[0][i], r.fields[1][i], r.fields[3][i], r.mask, 2)
                                   for r in reads])
            if gaps.size:
                assert row["perturbation"]["median"] == pytest.approx(float(np.median(gaps.astype(np.float64))), rel=1e-6)
            mismatched += row["mismatched"]
        assert line["tokens"] == sum(o["tokens"] for o in own)
        assert line["first_mismatch"]["none"] == sum(o["first_mismatch"]["none"] for o in own)
    return mismatched
