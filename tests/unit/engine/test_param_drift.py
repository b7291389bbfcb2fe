"""Parameter drift per module group (the secondary surface): a plain numpy reference of the sums, identical
parameters, frozen experts in a real Trainer fit, every family's parameters grouped once, the cost of a
gate, and the same figures on 2 gloo processes under DDP (exact), FSDP2 and ZeRO-3 (within tolerance)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import atlas_tracking.testing.parallel_models as pm
from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.engine.param_reference import ParamReference, named_unique_parameters, param_groups
from atlas_tracking.gate import AtlasGate
from atlas_tracking.receipts.param_drift import GROUPS, summarize, tensor_sums
from atlas_tracking.testing.distributed import run_workers
from atlas_tracking.testing.families import FAMILIES, ORIGINAL, family_model
from atlas_tracking.testing.tiny import POST_TRAINING, tiny_canary
from atlas_tracking.testing.trainer import records, tiny_model, tiny_sets, trainer_args


def _numpy_reference(now: dict[str, np.ndarray], ref: dict[str, np.ndarray], groups: dict[str, str]) -> dict:
    """Element by element: per group, sqrt(sum (a - b)^2) / sqrt(sum b^2), elements with a != b, elements."""
    acc = {g: [0.0, 0.0, 0, 0] for g in set(groups.values())}
    for name, group in groups.items():
        for a, b in zip(now[name].reshape(-1).tolist(), ref[name].reshape(-1).tolist()):
            acc[group][0] += (a - b) ** 2
            acc[group][1] += b ** 2
            acc[group][2] += int(a != b)
            acc[group][3] += 1
    out = {g: (float(np.sqrt(d / r)) if d else 0.0, m, n) for g, (d, r, m, n) in acc.items()}
    tot = [sum(v[i] for v in acc.values()) for i in range(4)]
    out["total"] = (float(np.sqrt(tot[0] / tot[1])), tot[2], tot[3])
    return out


def _figures(summary: dict) -> dict:
    out = {g: (e["relative_distance"], e["moved"], e["count"]) for g, e in summary["groups"].items()}
    t = summary["total"]
    out["total"] = (t["relative_distance"], t["moved"], t["count"])
    return out


def test_group_sums_match_a_numpy_loop():
    rng = np.random.default_rng(0)
    groups = {"a": "router", "b": "experts", "c": "experts", "d": "attention", "e": "norms"}
    ref = {k: rng.normal(size=(7, 5)).astype(np.float32) for k in groups}
    now = {k: v.copy() for k, v in ref.items()}
    now["a"] += rng.normal(size=(7, 5)).astype(np.float32) * 0.1
    now["c"][2, 3] += 1.0
    now["d"][rng.random((7, 5)) < 0.3] -= 0.5
    sums: dict[str, np.ndarray] = {}
    for k, g in groups.items():
        sums[g] = sums.get(g, np.zeros(4)) + tensor_sums(torch.from_numpy(now[k]), torch.from_numpy(ref[k]), chunk=4)
    got, want = _figures(summarize(sums)), _numpy_reference(now, ref, groups)
    assert set(got) == set(want)
    for g in want:
        assert got[g][0] == pytest.approx(want[g][0], rel=1e-12, abs=0)
        assert got[g][1:] == want[g][1:]
    assert got["norms"] == (0.0, 0, 35) and got["experts"][1] == 1


def test_identical_parameters_give_zero_distance_and_nothing_moved():
    model = pm.qwen3_moe()
    ref = ParamReference()
    ref.take(model, find_routed_layers(model))
    drift = ref.measure(model)
    assert drift["total"]["relative_distance"] == 0.0 and drift["total"]["moved"] == 0
    assert all(e["relative_distance"] == 0.0 and e["moved"] == 0 for e in drift["groups"].values())
    assert drift["total"]["count"] == sum(p.numel() for p in model.parameters())
    assert ref.host_bytes == sum(p.numel() * p.element_size() for p in model.parameters())


def test_changed_parameter_set_is_named_and_not_fatal(tmp_path, caplog):
    model = pm.qwen3_moe()
    gate = AtlasGate(model, pm.canary(4), {"receipts": {"progress": False}}, out_dir=tmp_path)
    gate.run(0)
    model.extra = torch.nn.Linear(2, 2)
    rec = gate.run(10)
    assert "param_drift" not in rec and "step 0: new ['extra.bias', 'extra.weight']\n" in caplog.text


def test_frozen_experts_never_move_while_the_rest_trains(tmp_path):
    """A real transformers Trainer fit of a tiny Qwen3-MoE with every expert frozen (``requires_grad=False``)."""
    from atlas_tracking.integrations.transformers import AtlasTrainerCallback
    from transformers import Trainer

    model = tiny_model()
    for layer in find_routed_layers(model):
        layer.experts.requires_grad_(False)
    train, val = tiny_sets(8)
    out = tmp_path / "out"
    trainer = Trainer(model, args=trainer_args(out, 8, eval_steps=4), train_dataset=train, eval_dataset=val)
    trainer.add_callback(AtlasTrainerCallback(canary=tiny_canary(), config=POST_TRAINING))
    trainer.train()
    recs = records(out)
    assert [r["step"] for r in recs] == [0, 4, 8] and "param_drift" not in recs[0]
    for rec in recs[1:]:
        d = rec["param_drift"]
        assert d["reference_step"] == rec["baseline_step"] == 0
        experts = d["groups"]["experts"]
        assert experts["moved"] == 0 and experts["relative_distance"] == 0.0 and experts["count"] > 0
        for group in ("router", "attention", "norms", "embeddings"):
            assert d["groups"][group]["moved"] > 0 and d["groups"][group]["relative_distance"] > 0
        assert d["total"]["moved"] == sum(d["groups"][g]["moved"] for g in d["groups"])
        assert d["total"]["count"] == sum(p.numel() for p in model.parameters())
    print(recs[-1]["param_drift"])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_of_each_family_is_in_one_group(family):
    model = family_model(family)
    layers = find_routed_layers(model)
    groups = param_groups(model, layers)
    params = {name: p for name, _, p in named_unique_parameters(model)}
    assert set(groups) == set(params) and set(groups.values()) <= set(GROUPS)
    ids = {id(p): g for g, p in ((groups[n], params[n]) for n in params)}
    for layer in layers:
        assert all(ids[id(p)] == "experts" for p in layer.experts.parameters())
        if layer.router is not layer.block:
            assert all(ids[id(p)] in ("router", "experts") for p in layer.router.parameters())
    counts = {g: sum(params[n].numel() for n in params if groups[n] == g) for g in GROUPS}
    assert sum(counts.values()) == sum(p.numel() for p in params.values())
    assert counts["experts"] > 0 and counts["router"] > 0 and counts["norms"] > 0 and counts["embeddings"] > 0
    if family in ORIGINAL:  # the name rules alone agree with the adapters on the common families
        assert param_groups(model) == groups


def _ddp_worker(rank: int, world: int) -> dict:
    model = pm.qwen3_moe()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ref = ParamReference()
    ref.take(ddp, find_routed_layers(model))
    pm.fill_(model, lambda name: name, perturb=0.05)
    return ref.measure(ddp) | {"host_bytes": ref.host_bytes}


def _different_worker(rank: int, world: int) -> dict:
    """Plain parameters that differ between the processes (no data parallelism): each process keeps its own."""
    model = pm.qwen3_moe()
    pm.fill_(model, lambda name: f"{name}.{rank}")
    ref = ParamReference()
    ref.take(model, find_routed_layers(model))
    pm.fill_(model, lambda name: f"{name}.{rank}", perturb=0.05)
    return ref.measure(model) | {"host_bytes": ref.host_bytes}


def _fsdp2_worker(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = pm.qwen3_moe()
    layers = find_routed_layers(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ref = ParamReference()
    ref.take(model, layers)
    pm.fill_(model, lambda name: name, perturb=0.05)
    drift = ref.measure(model)
    drift["held"] = sum(k.ref.numel() for k in ref.kept.values())
    return drift


def _zero3_worker(rank: int, world: int) -> dict:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    model = pm.qwen3_moe()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_batch_size": world, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    ref = ParamReference()
    ref.take(engine.module, find_routed_layers(engine.module))
    pm.fill_zero3(engine.module)
    drift = ref.measure(engine.module)
    drift["held"] = sum(k.ref.numel() for k in ref.kept.values())
    return drift


def _single_process() -> dict:
    model = pm.qwen3_moe()
    ref = ParamReference()
    ref.take(model, find_routed_layers(model))
    pm.fill_(model, lambda name: name, perturb=0.05)
    return ref.measure(model)


@pytest.mark.slow
def test_ddp_param_drift_equals_one_process_exactly_with_one_copy_of_the_replicas():
    one = _figures(_single_process())
    workers = run_workers(_ddp_worker, 2)
    assert [_figures(w) for w in workers] == [one, one]
    size = sum(p.numel() * p.element_size() for p in pm.qwen3_moe().parameters())
    assert [w["host_bytes"] for w in workers] == [size, 0]  # the replicas are kept by the first process alone
    assert all(w["reference"]["replicas_kept_once"] and w["reference"]["form"] == "exact" for w in workers)


@pytest.mark.slow
def test_processes_whose_parameters_differ_each_keep_their_own():
    workers = run_workers(_different_worker, 2)
    size = sum(p.numel() * p.element_size() for p in pm.qwen3_moe().parameters())
    assert [w["host_bytes"] for w in workers] == [size, size]
    assert not any(w["reference"]["replicas_kept_once"] for w in workers)
    assert _figures(workers[0]) != _figures(workers[1])  # each process's own parameters, summed on it alone


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "zero3"])
def test_sharded_parameters_add_up_to_one_process(layout):
    """Each process sums its shard (FSDP2 DTensor ``to_local()``; ZeRO-3 ``ds_tensor`` without the padding)."""
    if layout == "zero3":
        pytest.importorskip("deepspeed")
    one = _single_process()
    workers = run_workers(_fsdp2_worker if layout == "fsdp2" else _zero3_worker, 2)
    total = one["total"]["count"]
    assert all(w["held"] < total for w in workers)  # each process holds a shard only
    for w in workers:
        got = _figures(w)
        for g, (dist, moved, count) in _figures(one).items():
            assert got[g][1:] == (moved, count)
            assert got[g][0] == pytest.approx(dist, rel=1e-9)




def test_a_budget_keeps_every_nth_element_and_estimates_the_drift():
    model = pm.qwen3_moe()
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    exact, sampled = ParamReference(), ParamReference(budget_bytes=size // 8)
    exact.take(model, find_routed_layers(model))
    sampled.take(model, find_routed_layers(model))
    assert exact.form["form"] == "exact" and exact.form["reason"] is None
    assert sampled.form["form"] == "sampled" and sampled.form["stride"] == 8
    assert "gate.param_drift_budget_bytes" in sampled.form["reason"]
    assert sampled.host_bytes <= size // 8 + 4 * len(list(model.parameters()))
    still = sampled.measure(model)  # nothing moved: exactly 0, sampled or not
    assert still["total"]["moved"] == 0 and still["total"]["relative_distance"] == 0.0
    assert still["reference"]["form"] == "sampled"
    groups = param_groups(model, find_routed_layers(model))
    with torch.no_grad():
        for i, (name, _, p) in enumerate(named_unique_parameters(model)):
            if groups[name] in ("experts", "attention"):
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    truth, estimate = exact.measure(model), sampled.measure(model)
    for group in ("experts", "attention"):
        t, e = truth["groups"][group], estimate["groups"][group]
        kept = sum(k.ref.numel() for k in sampled.kept.values() if k.group == group)
        assert e["count"] == t["count"] and kept <= t["count"] // 8 + len(sampled.kept)
        # an estimate from `kept` elements: within 4 / sqrt(kept) relative (the stated 1 / sqrt scaling)
        assert e["relative_distance"] == pytest.approx(t["relative_distance"], rel=4 / kept ** 0.5)
        assert e["moved"] == pytest.approx(t["moved"], rel=4 / kept ** 0.5)
    for group in ("router", "norms", "embeddings"):  # frozen groups: exactly 0 from the kept elements too
        assert estimate["groups"][group]["moved"] == 0 and estimate["groups"][group]["relative_distance"] == 0.0


def test_the_gate_records_the_reference_form_from_its_budget(tmp_path):
    model = pm.qwen3_moe()
    gate = AtlasGate(model, pm.canary(4), {"receipts": {"progress": False},
                                           "gate": {"param_drift_budget_bytes": 1000}}, out_dir=tmp_path)
    gate.run(0)
    with torch.no_grad():
        next(model.parameters()).add_(0.1)
    rec = gate.run(1)
    gate.finish()
    ref = rec["param_drift"]["reference"]
    assert ref["form"] == "sampled" and ref["stride"] > 1 and "1000" in ref["reason"]
