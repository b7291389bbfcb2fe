"""``AtlasGate.rollout``: the plain-loop call a reinforcement-learning loop makes every step, on real models (a
transformers family, a Megatron-Core MoE layer, a DeepSpeed-MoE layer): the record, the trackers' bounded keys, the
alarm, the cadence, bad input that never stops the loop, and a resume that keeps one history."""

from __future__ import annotations

import contextlib
import copy
import json
import warnings

import numpy as np
import pytest
import torch

from atlas_tracking import AtlasGate, rollout_agreement
from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.artifacts.rollout_record import read_rollout
from atlas_tracking.schema.rollout import SUMMARY_KEYS
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.tiny import QUIET, random_canary


class Collector:
    """A sink that keeps what it is sent (the trackers' interface, in memory)."""

    name = "collector"

    def __init__(self):
        self.rollouts, self.alerts = [], []

    def log_gate(self, record, metrics, step):
        pass

    def log_rollout(self, line, metrics, step):
        self.rollouts.append((step, metrics))

    def alert(self, event):
        self.alerts.append(event)

    def finish(self):
        pass


def own_routes(model, ids):
    """``[batch, seq, layers, k]``: what each block's experts were called with, by the test's own hooks."""
    blocks = [layer.block for layer in find_routed_layers(model)]
    seen = [[] for _ in blocks]
    handles = [b.experts.register_forward_pre_hook(lambda m, args, i=i: seen[i].append(args[1].clone()))
               for i, b in enumerate(blocks)]
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    return torch.stack([torch.cat(s).view(*ids.shape, -1) for s in seen], dim=2)


def loop_gate(tmp_path, model, **rollout):
    sink = Collector()
    gate = AtlasGate(model, random_canary(), {**QUIET, "rollout": rollout}, out_dir=str(tmp_path / "atlas"),
                     sinks=[sink])
    return gate, sink


def test_each_step_is_written_first_then_sent_as_bounded_keys_with_the_alarm(tmp_path):
    model = family_model("qwen3_moe", seed=0).eval()
    rollout_model = copy.deepcopy(model).to(torch.bfloat16)
    gate, sink = loop_gate(tmp_path, model, mismatch_bound=0.0)         # any mismatch is a breach here
    lines = []
    for step in range(1, 5):
        ids = torch.randint(1, 64, (8, 32), generator=torch.Generator().manual_seed(step))
        routes = own_routes(rollout_model, ids)
        lines.append(gate.rollout(step, ids, routes))
        expected = rollout_agreement(model, ids, routes)
        assert [row["mismatched"] for row in lines[-1]["layers"]] == [row["mismatched"] for row in expected["layers"]]
    gate.finish()
    written = read_rollout(tmp_path / "atlas")
    assert [line["step"] for line in written] == [1, 2, 3, 4]
    assert [line["layers"] for line in written] == [line["layers"] for line in lines]
    assert written[0]["run_id"] == gate.run_id and written[0]["processes"] == 1
    assert [step for step, _ in sink.rollouts] == [1, 2, 3, 4]
    assert all(set(m) <= set(SUMMARY_KEYS.values()) and len(m) <= len(SUMMARY_KEYS) for _, m in sink.rollouts)
    worst = max(row["mismatch"] for row in written[0]["layers"])
    assert sink.rollouts[0][1]["atlas/rollout/mismatch_max"] == pytest.approx(worst)
    mismatching = [line for line in written if any(row["mismatched"] for row in line["layers"])]
    assert mismatching, "the bf16 copy routes some position differently"
    first = mismatching[0]
    assert first["breach"] and first["alarm"] and first["alerts"][0]["level"] == "WARN"
    assert "mismatch" in first["alerts"][0]["text"] and any(a["key"] == "rollout:bound" for a in sink.alerts)
    record = [json.loads(x) for x in (tmp_path / "atlas" / "alerts.jsonl").read_text().splitlines()]
    assert any(a["key"] == "rollout:bound" for a in record)


def test_the_cadence_measures_every_nth_step_and_the_others_cost_nothing(tmp_path):
    model = family_model("qwen3_moe", seed=0).eval()
    gate, _ = loop_gate(tmp_path, model, every_n_steps=2)
    ids = torch.randint(1, 64, (2, 16))
    routes = own_routes(model, ids)
    got = [gate.rollout(step, ids, routes) for step in range(1, 6)]
    assert [g is not None for g in got] == [False, True, False, True, False]
    assert [line["step"] for line in read_rollout(tmp_path / "atlas")] == [2, 4]
    assert all(row["mismatched"] == 0 for row in got[1]["layers"])                  # the model agrees with itself


def test_bad_input_warns_once_names_what_differs_and_the_loop_goes_on(tmp_path):
    model = family_model("qwen3_moe", seed=0).eval()
    gate, _ = loop_gate(tmp_path, model)
    ids = torch.randint(1, 64, (2, 16))
    routes = own_routes(model, ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert gate.rollout(1, ids, routes[:, :, :, :1]) is None                  # k = 1 against top-2
        assert gate.rollout(2, ids, routes[:, :, :, :1]) is None
    told = [str(w.message) for w in caught if "rollout agreement" in str(w.message)]
    assert len(told) == 1 and "k = 1; routed layer 0" in told[0]
    assert gate.rollout(3, ids, routes)["step"] == 3
    assert [line["step"] for line in read_rollout(tmp_path / "atlas")] == [3]


def test_a_resume_from_an_older_state_moves_later_steps_aside_and_keeps_the_alarm_state(tmp_path):
    model = family_model("qwen3_moe", seed=0).eval()
    gate, _ = loop_gate(tmp_path, model, mismatch_bound=0.0)
    ids = torch.randint(1, 64, (2, 16))
    routes = own_routes(model, ids).clone()
    routes[0, 0, 0, 0] = (routes[0, 0, 0, 0] + 1) % 6 if routes[0, 0, 0, 1] != (routes[0, 0, 0, 0] + 1) % 6 else \
        (routes[0, 0, 0, 0] + 2) % 6                                               # one planted mismatch
    gate.run(0)
    gate.rollout(1, ids, routes)
    state = gate.state_dict()
    gate.rollout(2, ids, routes)
    gate.rollout(3, ids, routes)
    gate.finish()
    again, _ = loop_gate(tmp_path, model, mismatch_bound=0.0)
    again.resume(1, state)
    assert again.rollouts.alarm.raised == ["model.layers.0.mlp"]          # the breach stands: no second alert
    line = again.rollout(2, ids, routes)
    assert line["alerts"] == []
    steps = [(x["step"], x["branch"]) for x in read_rollout(tmp_path / "atlas")]
    assert steps == [(1, gate.branch), (2, again.branch)]
    parked = [json.loads(x)["step"] for x in (tmp_path / "atlas" / "rollout.abandoned.jsonl").read_text().splitlines()]
    assert sorted(parked) == [2, 3]


def test_a_megatron_core_moe_layer_sequence_first_through_the_loop_call(tmp_path):
    pytest.importorskip("megatron.core")
    from atlas_tracking.testing.distributed import one_rank_env
    from atlas_tracking.testing.megatron_cpu import megatron_on_one_cpu_rank
    from atlas_tracking.testing.parallel_models import megatron_stack

    with contextlib.ExitStack() as stack:
        one_rank_env(stack.enter_context(pytest.MonkeyPatch.context()))
        stack.enter_context(megatron_on_one_cpu_rank())
        model, rollout_model = megatron_stack(), megatron_stack(perturb=0.05)   # the rollout engine's own weights
        ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
        theirs = []
        handles = [layer.router.register_forward_hook(lambda m, a, out: theirs.append(out[1].clone()))
                   for layer in find_routed_layers(rollout_model)]           # the routing map, [seq * batch, E]
        with torch.no_grad():
            rollout_model(ids)
        for h in handles:
            h.remove()
        mine = []
        handles = [layer.router.register_forward_hook(lambda m, a, out: mine.append(out[1].clone()))
                   for layer in find_routed_layers(model)]
        with torch.no_grad():
            model(ids)
        for h in handles:
            h.remove()
        routes = torch.stack([m.nonzero()[:, 1].view(16, 3, 2).transpose(0, 1) for m in theirs], dim=2)
        gate, _ = loop_gate(tmp_path, model)
        line = gate.rollout(5, ids, routes)
    for row, a, b in zip(line["layers"], mine, theirs):
        want = int((a != b).any(1).sum())                                   # positions whose sets differ
        assert (row["tokens"], row["mismatched"]) == (48, want)
    assert sum(row["mismatched"] for row in line["layers"]) > 0
    assert [row["layer"] for row in line["layers"]] == [0, 1]


def test_a_deepspeed_moe_layer_through_the_loop_call(tmp_path):
    pytest.importorskip("deepspeed")
    from atlas_tracking.integrations.deepspeed import deepspeed_layers

    from atlas_tracking.testing.deepspeed_lm import TinyDSLM, init_single_process

    init_single_process()
    model = TinyDSLM(vocab=64).eval()
    layers = deepspeed_layers(model)
    for layer in layers:
        layer.router.top2_2nd_expert_sampling = False        # a rollout engine routes without sampling
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    chosen = []
    handles = [layer.router.register_forward_hook(lambda m, a, out: chosen.append((a[0], out))) for layer in layers]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    routes = torch.stack([layer.routing(out, g.reshape(-1, g.shape[-1])).active.view(2, 16, -1)
                          for layer, (g, out) in zip(layers, chosen)], dim=2).clone()   # the trainer's own choice
    routes[1, 3, 1] = torch.tensor([7, 6]) if set(routes[1, 3, 1].tolist()) != {6, 7} else torch.tensor([0, 1])
    gate, _ = loop_gate(tmp_path, model)
    line = gate.rollout(1, ids, routes.numpy().astype(np.int32))
    assert [row["mismatched"] for row in line["layers"]] == [0, 1]
    assert line["first_mismatch"]["by_layer"] == {"0": 0, "1": 1}
