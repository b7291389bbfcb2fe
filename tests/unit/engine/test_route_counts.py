"""The counting hooks (engine/route_counts.py) on a real tiny transformers Qwen3-MoE: every training forward's
routes equal the test's own loop over the router's top-k index (:class:`~atlas_tracking.testing.collapse.OwnCounts`);
evaluation forwards, forwards inside ``paused()``, training-mode passes without gradients (a trainer's
log-probability passes) and activation checkpointing's recomputation (reentrant and not) are not counted; a counting
error never reaches the forward and is reported; the counts stay tensors on the router's device with no host read in
the hook."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.engine.route_counts import RouteCounter
from atlas_tracking.testing.collapse import OwnCounts

VOCAB, EXPERTS, TOP_K = 64, 8, 2


def _model(seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=EXPERTS, num_experts_per_tok=TOP_K))


def _batch(seed: int, rows: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def _train_step(model, optimizer, ids) -> None:
    out = model(ids, labels=ids)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _check(interval, own: OwnCounts, first: int, last: int, calls: int) -> None:
    load, tokens = own.between(first, last)
    assert [row["layer"] for row in interval.layers] == sorted(load)
    for row in interval.layers:
        assert row["load"] == load[row["layer"]], row["name"]  # integer counts of the same routes: exact
        assert row["tokens"] == tokens[row["layer"]] and sum(row["load"]) == TOP_K * row["tokens"]
        assert (row["calls"], row["processes"], row["dropped"]) == (calls, 1, None)


def test_training_forwards_are_counted_and_nothing_else():
    model = _model()
    layers = find_routed_layers(model)
    counter, own = RouteCounter(layers).attach(), OwnCounts(layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    for micro in range(3):  # three micro-batches of one optimizer step (accumulation)
        model(_batch(micro), labels=_batch(micro)).loss.backward()
    optimizer.step()
    own.end_step(1)
    model.eval()  # an evaluation forward, in and out of no_grad
    model(_batch(10))
    with torch.no_grad():
        model(_batch(11))
    model.train()
    with counter.paused():  # a gate's forwards in training mode
        model(_batch(12))
        with counter.paused():
            model(_batch(13))
        model(_batch(14))
    own.end_step(2)
    assert not counter._paused
    interval = counter.collect()
    _check(interval, own, 1, 1, calls=3)
    assert interval.errors == [] and sum(own.between(2, 2)[1].values()) == 3 * 32 * len(layers)  # the paused forwards did route
    # the counts start from zero; an interval without forwards is all zeros
    _train_step(model, optimizer, _batch(20, rows=3))
    own.end_step(3)
    _check(counter.collect(), own, 3, 3, calls=1)
    assert all(sum(row["load"]) == row["calls"] == 0 for row in counter.collect().layers)
    own.remove()


def _no_gradient_passes(model, own: OwnCounts, seed: int) -> None:
    """What a reinforcement-learning trainer runs between its updates, in training mode: old-policy and reference
    log-probabilities under ``torch.no_grad()`` and a pass under ``torch.inference_mode()``; none trains."""
    with own.skipping():
        with torch.no_grad():
            model(_batch(seed))
        with torch.inference_mode():
            model(_batch(seed + 1))


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_counts_each_forward_once(reentrant):
    model = _model(1)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    layers = find_routed_layers(model)
    counter, own = RouteCounter(layers).attach(), OwnCounts(layers, reentrant=reentrant)
    every_call = {layer.index: 0 for layer in layers}  # the routers' calls, recomputation included
    raw = [layer.router.register_forward_hook(lambda m, a, o, i=layer.index: every_call.update({i: every_call[i] + 1}))
           for layer in layers]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    for step in (1, 2):
        _no_gradient_passes(model, own, 50 + step)  # with gradients off, inside the checkpoint or not
        for micro in range(2):
            model(_batch(10 * step + micro), labels=_batch(10 * step + micro)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        own.end_step(step)
    # 4 forwards, each run again in its backward (the recomputation happened), and the 4 passes without gradients
    assert set(every_call.values()) == {12}
    _check(counter.collect(), own, 1, 2, calls=4)
    for handle in raw:
        handle.remove()
    own.remove()


def test_passes_without_gradients_in_training_mode_are_not_counted():
    model = _model(3)
    layers = find_routed_layers(model)
    counter, own = RouteCounter(layers).attach(), OwnCounts(layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    for step in (1, 2):
        _no_gradient_passes(model, own, 30 + step)
        _train_step(model, optimizer, _batch(step))
        own.end_step(step)
    _check(counter.collect(), own, 1, 2, calls=2)
    own.remove()


def test_a_counting_error_is_reported_and_training_continues(caplog):
    model = _model(2)
    layers = find_routed_layers(model)
    counter, own = RouteCounter(layers).attach(), OwnCounts(layers)
    broken = layers[1]

    def count_routes(router_inputs, router_output):  # a fault planted in one adapter
        raise RuntimeError("planted")

    broken.count_routes = count_routes
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    model.train()
    with caplog.at_level("WARNING", logger="atlas_tracking"):
        for step in (1, 2):
            _train_step(model, optimizer, _batch(step))
            own.end_step(step)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the optimizer stepped
    assert len([r for r in caplog.records if "cannot count" in r.getMessage()]) == 1  # said once
    interval = counter.collect()
    assert interval.errors == [f"{broken.name}: RuntimeError: planted"]
    load, _ = own.between(1, 2)
    for row in interval.layers:
        if row["layer"] == broken.index:
            assert sum(row["load"]) == row["calls"] == row["tokens"] == 0
        else:
            assert row["load"] == load[row["layer"]] and row["calls"] == 2
    del broken.count_routes  # mended: the next interval counts it and states no error
    _train_step(model, optimizer, _batch(3))
    own.end_step(3)
    interval = counter.collect()
    assert interval.errors == []
    _check(interval, own, 3, 3, calls=1)
    own.remove()


def test_reset_zeroes_and_the_counts_stay_tensors_on_the_router_device():
    model = _model(3).train()
    layers = find_routed_layers(model)
    counter = RouteCounter(layers).attach()
    model(_batch(0))
    for entry in counter._local:
        assert isinstance(entry.chosen, torch.Tensor) and entry.chosen.dtype == torch.int64
        assert entry.chosen.device == entry.layer.router.weight.device and entry.chosen.shape == (EXPERTS,)
        assert int(entry.chosen.sum()) == TOP_K * 32 and entry.dropped is None
    held = [entry.chosen for entry in counter._local]
    counter.reset()
    assert all(entry.chosen is t and not t.any() for entry, t in zip(counter._local, held))  # zeroed in place
    assert all(entry.tokens == entry.calls == 0 for entry in counter._local) and not counter.pending()
    assert all(sum(row["load"]) == 0 for row in counter.collect().layers)
    counter.detach()
    model(_batch(1))
    assert not counter.pending()  # detached: no hook left


def test_the_hook_never_reads_a_count_on_the_host():
    """The routers run on the meta device, where any host read (``.item()``, ``.tolist()``, ``bool()``) of a
    tensor raises: the hook counts, and its counts stay meta tensors until the interval closes."""
    model = _model(4).train()
    layers = find_routed_layers(model)
    counter = RouteCounter(layers).attach()
    for layer in layers:
        router = layer.router.to("meta")
        router(torch.empty(5, 32, device="meta"))
    assert counter._errors == {}
    for entry in counter._local:
        assert entry.chosen.device.type == "meta" and (entry.tokens, entry.calls) == (5, 1)
