"""A real deepspeed.moe.layer.MoE stack on CPU in one process: dispatch, recombination, gates, ZeRO-1.

Expert parallelism over several processes is tested in tests/e2e/test_expert_parallel.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from atlas_tracking.integrations.deepspeed import deepspeed_layers
from torch import nn

from atlas_tracking import AtlasConfig, Canary, measure
from atlas_tracking.engine.measure import measure_partial
from atlas_tracking.gate import AtlasGate
from atlas_tracking.testing.deepspeed_lm import TinyDSLM
from atlas_tracking.testing.distributed import one_rank_env

deepspeed = pytest.importorskip("deepspeed")

CFG = AtlasConfig.from_dict({"receipts": {"progress": False, "n_bootstrap": 100, "anchors": 32}})


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """One gloo rank for this module, its environment (which DeepSpeed reads at every engine) restored after,
    so later tests and the subprocesses they start do not inherit a stale MASTER_PORT or RANK."""
    with pytest.MonkeyPatch.context() as env:
        if not torch.distributed.is_initialized():
            one_rank_env(env)
            deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        yield
    torch.distributed.destroy_process_group()


class TinyLM(TinyDSLM):
    """examples/deepspeed_loop.py's model at test size, with spread router weights."""

    def __init__(self, experts=4, k=2, **moe_kw):
        super().__init__(vocab=64, d=16, layers=2, experts=experts, k=k, **moe_kw)
        with torch.no_grad():
            for b in self.blocks:
                b.moe.deepspeed_moe.gate.wg.weight.normal_(0, 1.0)


def _canary():
    return Canary.from_token_ids(np.random.default_rng(0).integers(0, 64, 4000), window=16, n_windows=4, seed=0)


def _capture(model, ids):
    layers = deepspeed_layers(model)
    seen = {lay.name: {} for lay in layers}
    hs = []
    for lay in layers:
        d = seen[lay.name]
        hs += [lay.norm.register_forward_hook(lambda m, i, o, d=d: d.update(g=o)),
               lay.router.register_forward_hook(lambda m, i, o, d=d: d.update(r=o)),
               lay.block.register_forward_hook(lambda m, i, o, d=d: d.update(out=o[0]))]
    with torch.no_grad(), layers[0].gate_context(), layers[1].gate_context():
        model(ids)
    for h in hs:
        h.remove()
    return layers, seen


@pytest.mark.parametrize("kw", [{"k": 2, "top2_2nd_expert_sampling": True},
                                {"k": 1, "capacity_factor": 0.5, "eval_capacity_factor": 0.5},
                                {"k": 2, "use_residual": True}, {"k": 3}])
def test_active_sets_equal_dispatch_and_fields_recombine_to_the_output(kw):
    model = TinyLM(**kw).eval()
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    layers, seen = _capture(model, ids)
    for lay in layers:
        d = seen[lay.name]
        g = d["g"].reshape(-1, 16)
        routing = lay.routing(d["r"], g)
        dispatch = d["r"][3].t().long()
        kept = dispatch >= 0
        assert torch.equal(routing.active[kept], dispatch[kept])
        assert torch.equal(routing.dropped, ~kept)
        again = lay.route(g)  # re-routing (anchors, ov_cf) without calling the gate: the same choice, and the
        assert torch.equal(again.active, routing.active) and torch.equal(again.probs, routing.probs)
        whole = kept.all(dim=1)  # same weights where the capacity dropped none of a token's routes
        assert whole.any() and torch.allclose(again.weights[whole], routing.weights[whole], atol=1e-6)
        with torch.no_grad():
            u = lay.expert_outputs(g, routing.active)
            combined = (routing.weights.unsqueeze(-1) * u).sum(1)
            shared = lay.shared_output(g)
            if shared is not None:
                combined = combined + shared
        out = d["out"].reshape(-1, 16)
        assert (combined - out).norm() / out.norm() < 1e-5
        if kw.get("eval_capacity_factor"):
            assert routing.dropped.any()  # capacity drops happen and are explicit


def test_gate_switches_off_sampling_and_restores_it():
    model = TinyLM(k=2, top2_2nd_expert_sampling=True).eval()
    report = measure(model, _canary(), config=CFG, layers=deepspeed_layers(model))
    assert all(lay.router.top2_2nd_expert_sampling for lay in deepspeed_layers(model))
    assert all(layer["receipts"]["rank_violations"] == 0 for layer in report.layers)
    again = measure(model, _canary(), config=CFG, layers=deepspeed_layers(model))
    assert again.to_json() == report.to_json()  # deterministic routing during gates


def test_dropped_routes_are_a_receipt():
    model = TinyLM(k=1, capacity_factor=0.5, eval_capacity_factor=0.5).eval()
    report = measure(model, _canary(), config=CFG, layers=deepspeed_layers(model))
    assert all(layer["receipts"]["dropped_routes"] > 0 for layer in report.layers)


def test_random_token_selection_drops_the_same_tokens_whatever_share_a_process_measures():
    """Top-1 with random token selection over capacity: the tokens dropped in a micro-batch depend on its windows
    and the layer, not on the micro-batches a process ran before it (rank 1 of 2 runs windows 2-3 first)."""
    model = TinyLM(k=1, capacity_factor=0.5, eval_capacity_factor=0.5).eval()
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "batch_windows": 2}})

    def share(rank: int, world: int) -> dict:
        return measure_partial(model, _canary(), cfg, deepspeed_layers(model), rank, world)

    one = share(0, 1)
    assert all(layer["dropped_routes"].sum() > 0 for layer in one["layers"])
    for rank in (0, 1):
        part = share(rank, 2)
        own = part["owned"]
        assert own.sum() == 2
        for a, b in zip(one["layers"], part["layers"]):
            assert np.array_equal(a["dropped_routes"][own], b["dropped_routes"][own])
            # the same micro-batch in another process order: equal to rounding (a different drop moves these ~1e-2)
            assert np.allclose(a["margin_mean.sum"][own], b["margin_mean.sum"][own], rtol=0, atol=1e-5)
        assert np.allclose(one["nll_sum"][own], part["nll_sum"][own], rtol=0, atol=1e-5)


def test_a_gate_leaves_the_random_stream_of_training_as_it_was():
    model = TinyLM(k=1, capacity_factor=0.5, eval_capacity_factor=0.5).eval()
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    measure(model, _canary(), config=CFG, layers=deepspeed_layers(model))
    assert torch.equal(torch.rand(4), expected)


def test_discovery_without_explicit_layers_and_under_zero1_engine(tmp_path):
    model = TinyLM(k=2)
    before = measure(model.eval(), _canary(), config=CFG)
    assert [lay["family"] for lay in before.layers] == ["deepspeed", "deepspeed"]
    cfg = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 1}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    after = measure(engine.module, _canary(), config=CFG)
    assert after.to_json() == before.to_json()
    gate = AtlasGate(engine.module, _canary(), CFG, out_dir=tmp_path, layers=deepspeed_layers(engine))
    assert gate.run(0)["status"] == "BASELINE"
    ids = torch.randint(0, 64, (4, 16))
    loss = nn.functional.cross_entropy(engine(ids).reshape(-1, 64), ids.reshape(-1))
    engine.backward(loss)
    engine.step()
    rec = gate.run(1, loss=float(loss))
    assert rec["status"] in ("GREEN", "YELLOW", "RED") and rec["layers"][0]["boundary_drift"] is not None


def test_a_layernorm_pre_norm_is_read_on_the_layernorm_state():
    """A block whose pre-norm is a ``torch.nn.LayerNorm`` (with a bias) is read as one: the self-check's gain
    column is exact, verify passes and the model drifts by exactly 0 against itself; read as an RMSNorm, the
    same layer fails the gain check."""
    from atlas_tracking import Baseline
    from atlas_tracking.artifacts.gate_report import verify
    from atlas_tracking.engine.selfcheck import AdapterCheckError

    model = TinyLM().eval()
    with torch.no_grad():
        for b in model.blocks:
            b.norm2 = nn.LayerNorm(16, eps=1e-5)
            b.norm2.weight.normal_(1.0, 0.1)
            b.norm2.bias.normal_(0.0, 0.1)
    layers = deepspeed_layers(model)
    assert [lay.norm_type for lay in layers] == ["layernorm", "layernorm"]
    report = measure(model, _canary(), config=CFG, layers=layers)
    assert verify(report.to_dict()) == []
    assert all(layer["selfcheck"]["gain"] < 1e-6 for layer in report.layers)
    again = measure(model, _canary(), config=CFG, layers=deepspeed_layers(model),
                    baseline=Baseline.from_report(report))
    assert all(layer[k] == 0.0 for layer in again.drift["layers"]
               for k in ("coord_drift", "boundary_drift", "transition_drift", "content_drift"))
    as_rms = deepspeed_layers(model)
    for lay in as_rms:
        lay.norm_type = "rms"
    with pytest.raises(AdapterCheckError, match=r"\[gain: "):
        measure(model, _canary(), config=CFG, layers=as_rms)
