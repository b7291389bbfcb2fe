"""measure() on a real model against an independent per-token reference; determinism; sharding; verify; NLL."""

from __future__ import annotations

import copy
import json
import math
import pickle

import numpy as np
import pytest
import torch

from atlas_tracking import AtlasConfig, Baseline, Canary, measure
from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.artifacts.gate_report import verify
from atlas_tracking.engine.anchors import AnchorPlan
from atlas_tracking.engine.capture import FIELD_ROWS_BUDGET
from atlas_tracking.engine.measure import build_report, measure_partial
from atlas_tracking.engine.selfcheck import SelfCheck
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.tolerance import assert_within_tolerance

CFG = AtlasConfig.from_dict({"receipts": {"progress": False, "n_bootstrap": 200, "batch_windows": 2, "anchors": 32}})


@pytest.fixture(scope="module")
def model():
    return family_model("qwen3_moe", seed=3)


@pytest.fixture(scope="module")
def canary():
    ids = np.random.default_rng(0).integers(0, 64, 4000)
    return Canary.from_token_ids(ids, window=20, n_windows=6, seed=0)


def _norm(v):
    return math.sqrt(sum(x * x for x in v))


def _reference_layer(model, canary, name, q=0.1, deltas=(0.01,)):
    """Plain-loop receipts of one layer from our own hooks and one-token-at-a-time expert calls."""
    lay = next(lay for lay in find_routed_layers(model) if lay.name == name)
    got = {}
    hs = [lay.norm.register_forward_hook(lambda m, i, o: got.update(x=i[0], g=o)),
          lay.router.register_forward_hook(lambda m, i, o: got.update(r=o)),
          lay.block.register_forward_hook(lambda m, i, o: got.update(out=o))]
    with torch.no_grad():
        model(input_ids=torch.from_numpy(canary.windows))
    for h in hs:
        h.remove()
    W, L = canary.windows.shape
    x = got["x"].reshape(W * L, -1).double().numpy()
    g = got["g"].reshape(W * L, -1)
    logits = got["r"][0].double().numpy()
    act = got["r"][2].numpy()
    out = got["out"].reshape(W * L, -1)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    E, k = logits.shape[1], act.shape[1]

    def field(t, e):
        with torch.no_grad():
            u = lay.experts(g[t : t + 1], torch.tensor([[e]]), torch.ones(1, 1)).double().numpy()[0]
        r = math.sqrt(float((x[t] ** 2).mean()) + lay.norm_eps)
        z = x[t] / r
        zh = z / _norm(z)
        return u - float(np.dot(zh, u)) * zh

    margins, c2s, d_adj = [], [], []
    for t in range(W * L):
        sel = list(act[t])
        e_k = min(sel, key=lambda e: logits[t, e])
        e_k1 = max((e for e in range(E) if e not in sel), key=lambda e: logits[t, e])
        margins.append(logits[t, e_k] - logits[t, e_k1])
        v = {e: field(t, e) for e in [*sel, e_k1]}
        rho = {e: probs[t, e] / sum(probs[t, s] for s in sel) for e in sel}
        num = den = 0.0
        for a in sel:
            for b in sel:
                if a != b:
                    w = rho[a] * rho[b] * math.exp(-1.0 * abs(logits[t, a] - logits[t, b]))
                    num += w * np.dot(v[a], v[b]) / (_norm(v[a]) * _norm(v[b]) + 1e-8)
                    den += w
        c2s.append(num / den)
        d_adj.append(_norm(v[e_k] - v[e_k1]) / (_norm(v[e_k]) + _norm(v[e_k1]) + 1e-8))
    loads = [sum(1 for t in range(W * L) if e in act[t]) for e in range(E)]
    mean = sum(loads) / E
    f = [c / sum(loads) for c in loads]
    with torch.no_grad():
        post = lay.norm(got["x"].reshape(W * L, -1) + out)
        act_post = lay.router(post)[2].numpy()
    ov = [len(set(act[t]) & set(act_post[t])) / k for t in range(W * L)]
    b_sum = b_n = i_sum = i_n = 0.0
    for w in range(W):
        toks = list(range(w * L, (w + 1) * L))
        n_b = math.ceil(q * L - 1e-9)
        border = set(sorted(toks, key=lambda t: (margins[t], t))[:n_b])
        for t in toks:
            if t in border:
                b_sum, b_n = b_sum + d_adj[t], b_n + 1
            else:
                i_sum, i_n = i_sum + d_adj[t], i_n + 1
    return {
        "margin_mean": float(np.mean(margins)), "c2": float(np.mean(c2s)), "ov_cf": float(np.mean(ov)),
        "dead_experts": sum(1 for c in loads if c == 0),
        "load_cv": math.sqrt(sum((c - mean) ** 2 for c in loads) / E) / mean,
        "router_entropy": -sum(p * math.log(p) for p in f if p > 0),
        "boundary_mass@0.01": sum(1 for m in margins if m <= deltas[0]) / len(margins),
        "v2_c1": b_sum / b_n - i_sum / i_n,
    }


def test_layer_receipts_match_an_independent_reference(model, canary):
    report = measure(model, canary, config=CFG)
    for name in ("model.layers.0.mlp", "model.layers.1.mlp"):
        ref = _reference_layer(model, canary, name)
        got = report.layer(name)["receipts"]
        for key, value in ref.items():
            assert got[key] == pytest.approx(value, abs=2e-5), (name, key)
        assert got["pi_sum"] == pytest.approx(2.0) and got["rank_violations"] == 0


def test_bit_identical_json_twice(model, canary):
    assert measure(model, canary, config=CFG).to_json() == measure(model, canary, config=CFG).to_json()


def test_two_simulated_ranks_agree_with_one(model, canary):
    layers = find_routed_layers(model)
    whole = measure(model, canary, config=CFG, keep_anchors=False)
    parts = [measure_partial(model, canary, CFG, layers, rank, 2) for rank in (0, 1)]
    merged = build_report(parts, layers, canary, CFG, model, None)
    assert_within_tolerance(json.loads(whole.to_json()), json.loads(merged.to_json()))  # across world sizes


def test_two_ranks_anchors_are_joined_in_anchor_order(model, canary):
    """A baseline's anchors from two shards, each spooled by its own rank, equal one process's."""
    layers = find_routed_layers(model)
    plan = AnchorPlan.select(canary, CFG.receipts.anchors, CFG.receipts.seed)
    whole = measure(model, canary, config=CFG)
    parts = [measure_partial(model, canary, CFG, layers, rank, 2, anchors=plan, collect=True) for rank in (0, 1)]
    parts = [pickle.loads(pickle.dumps(p)) for p in parts]  # as a distributed gate's gather sends them
    merged = build_report(parts, layers, canary, CFG, model, None, plan)
    one, two = whole.anchors["tensors"], merged.anchors["tensors"]
    assert sorted(one) == sorted(two) and len(one) == len(layers) * 10 + 3  # 5 anchor tensors, g0, gamma0, co-movement's 3; kl
    for key in one:  # other micro-batches on two ranks: the same rows, within the world-size tolerance
        assert one[key].shape == two[key].shape and one[key].dtype == two[key].dtype
        assert torch.allclose(one[key].double(), two[key].double(), rtol=0, atol=1e-5), key


def test_verify_accepts_and_then_catches_tampering(model, canary):
    data = json.loads(measure(model, canary, config=CFG).to_json())
    assert verify(data) == []
    tampered = copy.deepcopy(data)
    tampered["per_window"]["layers"][0]["c2"]["sum"][1] += 0.5
    assert any("c2" in p for p in verify(tampered))
    tampered = copy.deepcopy(data)
    tampered["layers"][1]["receipts"]["dead_experts"] += 1
    assert any("dead_experts" in p for p in verify(tampered))
    tampered = copy.deepcopy(data)
    tampered["summary"]["min_entropy"] = 0.0
    assert any("min_entropy" in p for p in verify(tampered))


def test_verify_fails_a_cosine_outside_its_range(model, canary):
    """An artifact whose C2 left [-1, 1] (as the subtracted Gram form gave on identity experts) fails ``verify``
    even where the stored value is the one its per-window sums give."""
    data = json.loads(measure(model, canary, config=CFG).to_json())
    pw = data["per_window"]["layers"][0]["c2"]
    pw["sum"] = [-13.3 * c for c in pw["count"]]
    data["layers"][0]["receipts"]["c2"] = -13.3
    problems = verify(data)
    assert any("c2 is -13.3, outside [-1, 1]" in p for p in problems), problems
    assert any("window 0 c2 mean -13.3 is outside [-1, 1]" in p for p in problems), problems


def test_canary_nll_equals_the_models_own_loss(model, canary):
    report = measure(model, canary, config=CFG)
    pw = report.per_window["canary_nll"]
    for w in range(canary.n_windows):
        ids = torch.from_numpy(canary.windows[w : w + 1])
        with torch.no_grad():
            loss = float(model(input_ids=ids, labels=ids).loss)
        assert pw["sum"][w] / pw["count"][w] == pytest.approx(loss, abs=1e-5)


def test_fused_and_unfused_experts_agree_and_the_forward_is_unchanged(model, canary):
    fused = measure(model, canary, config=CFG)
    unfused = measure(model, canary, config=AtlasConfig.from_dict(
        {"receipts": {**CFG.to_dict()["receipts"], "fuse_experts": False}}))
    for a, b in zip(fused.layers, unfused.layers):
        for key in ("c2", "margin_mean", "ov_cf", "v2_c1", "v2_c2", "dead_experts", "transition_incompat"):
            assert a["receipts"][key] == pytest.approx(b["receipts"][key], abs=1e-5), key
    assert fused.summary["canary_nll"] == pytest.approx(unfused.summary["canary_nll"], abs=1e-5)
    layer = find_routed_layers(model)[0]
    assert "forward" not in layer.experts.__dict__ and layer.experts_forward is None  # restored after the gate


@pytest.mark.parametrize("mode", ["gate", "collecting a baseline", "with drift", "one call per layer"])
def test_a_gate_is_one_forward_pass(model, canary, mode):
    """Counts calls, not seconds: one model forward per micro-batch; per layer and micro-batch, one call of the
    experts for the active set (the rows of the model's own call) and as many for the competitors as keep each
    within the forward's own expert rows (N k), the random competitors riding along in the last; with a large
    ``token_chunk`` that is one; the anchors come in a call of their own. At its first call a layer also runs
    the experts' own forward (which its combine must equal bit for bit), as does a padded micro-batch; the
    adapter self-check adds one call of the experts' own forward per layer and gate, on a few tokens (their fields
    ride in the competitors' call)."""
    cfg = CFG if mode != "one call per layer" else AtlasConfig.from_dict(
        {"receipts": {**CFG.to_dict()["receipts"], "token_chunk": 1 << 20}})
    baseline = Baseline.from_report(measure(model, canary, config=cfg)) if mode == "with drift" else None
    calls = {"model": 0, "experts": 0}
    h1 = model.register_forward_pre_hook(lambda m, a, kw: calls.__setitem__("model", calls["model"] + 1),
                                         with_kwargs=True)
    layers = find_routed_layers(model)
    original = type(layers[0].experts).forward

    def counting(self, *a, **kw):
        calls["experts"] += 1
        return original(self, *a, **kw)

    type(layers[0].experts).forward = counting
    try:
        report = measure(model, canary, baseline=baseline, config=cfg, keep_anchors=mode == "collecting a baseline")
    finally:
        type(layers[0].experts).forward = original
        h1.remove()
    assert (report.anchors is not None) == (mode == "collecting a baseline")
    assert (report.drift is not None) == (mode == "with drift")
    batches = canary.batches(cfg.receipts.batch_windows)
    assert calls["model"] == len(batches)
    k = layers[0].top_k
    d, tokens = layers[0].hidden_size, [(e - s) * canary.window for s, e in batches]
    per_call = [cfg.receipts.token_chunk or max(n * k // 2, FIELD_ROWS_BUDGET // d) // (k + 1) for n in tokens]
    expected = sum(math.ceil(n / c) for n, c in zip(tokens, per_call)) * len(layers)
    assert expected == len(batches) * len(layers)  # a narrow model: one competitors' call per layer and micro-batch
    padded = sum(e - s < cfg.receipts.batch_windows for s, e in batches)
    # plus the active sets' calls, one call per micro-batch for the anchors a baseline collects or drift reads,
    # the experts' own forward at each layer's first and padded calls, and the adapter self-check's call of the
    # experts' own forward on SAMPLE_TOKENS tokens
    anchors = expected if mode in ("collecting a baseline", "with drift") else 0
    assert calls["experts"] == 2 * expected + anchors + (1 + padded) * len(layers) + len(layers)


def test_wide_layers_evaluate_fields_in_calls_within_half_the_forward_rows(model, canary, monkeypatch):
    """With a budget below one micro-batch's rows, the fields come in several calls, each within half the
    forward's (token, expert) rows, and every receipt is unchanged (the unfused path, where every field is
    evaluated in chunks; the fused path evaluates the active set in the model's own rows)."""
    import atlas_tracking.engine.capture as capture

    cfg = AtlasConfig.from_dict({"receipts": {**CFG.to_dict()["receipts"], "fuse_experts": False}})
    one = measure(model, canary, config=CFG)
    layers = find_routed_layers(model)
    rows: list[int] = []
    original = type(layers[0].experts).forward

    def counting(self, hidden_states, top_k_index, *a, **kw):
        if top_k_index.shape[-1] == 1:  # the gate's field calls (the model's own call hands k per token)
            rows.append(hidden_states.shape[0])
        return original(self, hidden_states, top_k_index, *a, **kw)

    monkeypatch.setattr(capture, "FIELD_ROWS_BUDGET", 1)
    # only the capture's field calls are counted here: the self-check's call of the experts' own is left out
    monkeypatch.setattr(SelfCheck, "_expert_checks", lambda self, *a: torch.float32)
    monkeypatch.setattr(type(layers[0].experts), "forward", counting)
    chunked = measure(model, canary, config=cfg)
    n, k = CFG.receipts.batch_windows * canary.window, layers[0].top_k
    per_batch = len(rows) // (len(canary.batches(CFG.receipts.batch_windows)) * len(layers))
    assert per_batch == math.ceil(n / (n * k // 2 // (k + 1))) + 1  # the chunks, then the anchors' own call
    assert per_batch > 2
    for calls in np.array(rows).reshape(-1, per_batch):  # per layer and micro-batch, in order
        assert all(r <= n * k // 2 for r in calls[:-2])  # the last chunk also carries the random competitors
    for a, b in zip(one.layers, chunked.layers):
        for key in ("c2", "margin_mean", "ov_cf", "v2_c1", "v2_c2", "transition_incompat"):
            assert a["receipts"][key] == pytest.approx(b["receipts"][key], abs=1e-6), key


def test_the_chunks_fit_in_the_memory_free_when_the_gate_starts(model, canary, monkeypatch):
    """With little memory free on the device, the competitors' fields come in calls whose rows fit in a quarter of
    it (docs/receipts.md#memory), and the receipts are those of one call per micro-batch within rounding."""
    import atlas_tracking.engine.measure as measure_module
    from atlas_tracking.engine.free_memory import field_rows

    layers = find_routed_layers(model)
    d, k = layers[0].hidden_size, layers[0].top_k
    roomy = measure(model, canary, config=CFG)
    free = 7 * d * (2 * 4 + 4 * 3) * 4  # seven fp32 rows of width d in a quarter of it
    assert field_rows(free, d, 4) == 7
    monkeypatch.setattr(measure_module, "free_bytes", lambda device: free)
    rows: list[int] = []
    original = type(layers[0].experts).forward

    def counting(self, hidden_states, top_k_index, *a, **kw):
        if top_k_index.shape[-1] == 1:
            rows.append(hidden_states.shape[0])
        return original(self, hidden_states, top_k_index, *a, **kw)

    monkeypatch.setattr(type(layers[0].experts), "forward", counting)
    tight = measure(model, canary, config=CFG)
    n = CFG.receipts.batch_windows * canary.window
    chunks = [r for r in rows if r <= 7]  # the competitors' calls: one row per token
    assert len(chunks) >= len(layers) * len(canary.batches(CFG.receipts.batch_windows)) * (n // 7)
    assert max(rows) == n * k  # the active set's call holds the model's own rows, whatever the memory
    for a, b in zip(roomy.layers, tight.layers):
        for key in ("c2", "margin_mean", "ov_cf", "v2_c1", "v2_c2", "transition_incompat"):
            assert a["receipts"][key] == pytest.approx(b["receipts"][key], abs=1e-6), key
