"""Base-domain damage: kl_base (bounded KL(base || now) from the baseline's top-K) and canary_nll_delta.

References are plain numpy loops in float64. The trained model is a tiny byte-level Qwen3-MoE
(vocabulary 256, the demo's tokens) trained for 400 steps on the demo's prose; the candidate
continues it for 30 steps on Python source (a domain shift), and ``compare`` gives the bounded
and the exact KL side by side.
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from atlas_tracking import AtlasConfig, Baseline, Canary, measure
from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.artifacts.baseline import BaselineError
from atlas_tracking.artifacts.gate_report import verify
from atlas_tracking.artifacts.record import gate_metrics, gate_record
from atlas_tracking.cli import main
from atlas_tracking.engine.measure import attach_drift, build_report, measure_partial
from atlas_tracking.receipts.kl import base_topk, window_kl, window_kl_exact
from atlas_tracking.schema.config import ConfigError
from atlas_tracking.testing.demo_data import code_text, encode, prose_text
from atlas_tracking.testing.tolerance import FLOAT_TOL

CFG = AtlasConfig.from_dict({"receipts": {"progress": False, "n_bootstrap": 200, "anchors": 64, "batch_windows": 4}})
WINDOW, N_WINDOWS = 32, 8
BOUNDED_GAP = 0.05
"""Stated distance of the bounded KL (K = 32) below the exact one on the trained byte-level model, as a
fraction of the exact KL (measured: 0.0122 of 0.4267 nats/token, 2.9%, on a plain forward of 8 windows)."""


# --- numpy references -------------------------------------------------------------------------------------


def _softmax64(row: np.ndarray) -> np.ndarray:
    z = np.exp(row.astype(np.float64) - row.max())
    return z / z.sum()


def reference_kl(base: np.ndarray, now: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-window coarse-grained and exact KL sums over the predicted tokens, one token at a time."""
    b, t, v = base.shape
    coarse, exact = np.zeros(b), np.zeros(b)
    for w in range(b):
        for pos in range(t - 1):
            p, q = _softmax64(base[w, pos]), _softmax64(now[w, pos])
            top = set(np.argsort(-p, kind="stable")[:k].tolist())
            head, r, q_top = 0.0, 0.0, 0.0
            for tok in range(v):
                if p[tok] > 0:
                    exact[w] += p[tok] * math.log(p[tok] / q[tok])
                if tok in top:
                    head += p[tok] * math.log(p[tok] / q[tok])
                    q_top += q[tok]
                else:
                    r += p[tok]
            coarse[w] += head + (r * math.log(r / (1.0 - q_top)) if r > 0 else 0.0)
    return coarse, exact


def _random_logits(seed: int, b: int = 3, t: int = 6, v: int = 40, scale: float = 3.0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(0, scale, (b, t, v))).float()


@pytest.mark.parametrize("k", [1, 5, 40])  # k = 40 = vocabulary: r = 0 and the bound is the exact KL
def test_bounded_and_exact_kl_agree_with_numpy_loops(k):
    base, now = _random_logits(0), _random_logits(1)
    ref_coarse, ref_exact = reference_kl(base.numpy(), now.numpy(), k)
    logp, index, log_rest = base_topk(base, k)
    bounded, n = window_kl(now, logp, index, log_rest)
    exact, _ = window_kl_exact(base, now)
    np.testing.assert_allclose(bounded.numpy(), ref_coarse, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(exact.numpy(), ref_exact, rtol=1e-6, atol=1e-6)
    assert n.tolist() == [5, 5, 5]
    assert (bounded <= exact + 1e-5).all()
    if k == 40:
        assert torch.isneginf(log_rest).all()


def test_tiny_remaining_mass_is_stable():
    """Top-K logits 30 nats above the rest: r ~ 1e-12, far below fp32's resolution of 1 - sum(p)."""
    base, now = _random_logits(2, scale=0.5), _random_logits(3, scale=0.5)
    base[..., :4] += 30.0
    now[..., :4] += 29.0
    logp, index, log_rest = base_topk(base, 4)
    r = np.exp(log_rest.double().numpy())
    ref_r = np.array([[sum(_softmax64(row)[4:]) for row in win] for win in base.numpy()[:, :-1]])
    np.testing.assert_allclose(r, ref_r, rtol=1e-5)
    assert (r > 0).all() and (r < 1e-10).all()
    ref_coarse, _ = reference_kl(base.numpy(), now.numpy(), 4)
    np.testing.assert_allclose(window_kl(now, logp, index, log_rest)[0].numpy(), ref_coarse, rtol=1e-6, atol=1e-6)


def test_identical_logits_give_exactly_zero():
    base = _random_logits(4, v=300)
    assert window_kl(base, *base_topk(base, 32))[0].tolist() == [0.0, 0.0, 0.0]
    assert window_kl_exact(base, base)[0].tolist() == [0.0, 0.0, 0.0]


# --- a trained byte-level model ---------------------------------------------------------------------------


def _model(seed: int = 0, vocab: int = 256) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2)).eval()


def _train(model: Qwen3MoeForCausalLM, stream: np.ndarray, steps: int, seed: int) -> Qwen3MoeForCausalLM:
    rng = np.random.default_rng(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = rng.integers(0, len(stream) - WINDOW - 1, 8)
        ids = torch.from_numpy(np.stack([stream[s:s + WINDOW] for s in starts]))
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def trained():
    prose = encode(prose_text())
    cut = int(0.9 * len(prose))
    base = _train(_model(), prose[:cut], 400, seed=0)
    cand = _train(copy.deepcopy(base), encode(code_text(200_000)), 30, seed=1)
    canary = Canary.from_token_ids(prose[cut:], window=WINDOW, n_windows=N_WINDOWS, seed=0)
    return base, cand, canary


@pytest.fixture(scope="module")
def baseline(trained):
    base, _, canary = trained
    return Baseline.from_report(measure(base, canary, config=CFG))


def test_identical_model_gives_exact_zero_kl_and_nll_delta(trained, baseline):
    base, _, canary = trained
    report = measure(base, canary, baseline=baseline, config=CFG)
    d = report.drift
    assert d["kl_base"] == 0.0 and d["kl_base_ci"] == [0.0, 0.0]
    assert d["canary_nll_delta"] == 0.0 and d["canary_nll_delta_ci"] == [0.0, 0.0]
    assert "kl_base_absent" not in d
    assert verify(json.loads(report.to_json())) == []
    rec = gate_record(report, None, step=1, loss=None)
    assert rec["kl_base"] == 0.0 and rec["canary_nll_delta"] == 0.0 and rec["kl_base_ci"] == [0.0, 0.0]
    m = gate_metrics(rec)
    assert m["atlas/kl_base"] == 0.0 and m["atlas/canary_nll_delta"] == 0.0


def test_gate_kl_and_nll_delta_match_references(trained, baseline):
    base, cand, canary = trained
    report = measure(cand, canary, baseline=baseline, config=CFG)
    ids = torch.from_numpy(canary.windows)
    with torch.no_grad():
        p, q = base(input_ids=ids).logits, cand(input_ids=ids).logits
    ref_coarse, ref_exact = reference_kl(p.numpy(), q.numpy(), 32)
    pw = report.per_window["kl_base"]
    # the gate's forward combines experts in fp32 inside its hooks: not bit-identical to a plain forward
    np.testing.assert_allclose(np.asarray(pw["sum"]), ref_coarse, rtol=1e-4, atol=1e-5)
    assert pw["count"].tolist() == [WINDOW - 1] * N_WINDOWS
    assert (np.asarray(pw["sum"]) <= ref_exact + 1e-4).all()
    assert report.drift["kl_base"] == pytest.approx(ref_coarse.sum() / (N_WINDOWS * (WINDOW - 1)), rel=1e-4)
    lo, hi = report.drift["kl_base_ci"]
    assert 0 < lo <= report.drift["kl_base"] <= hi
    nll_now = torch.nn.functional.cross_entropy(q[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1)).item()
    nll_base = torch.nn.functional.cross_entropy(p[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1)).item()
    assert report.drift["canary_nll_delta"] == pytest.approx(nll_now - nll_base, abs=1e-4)
    assert verify(json.loads(report.to_json())) == []


def test_compare_gives_bounded_below_and_near_exact_kl(trained, tmp_path, capsys):
    base, cand, canary = trained
    base.save_pretrained(tmp_path / "base")
    cand.save_pretrained(tmp_path / "cand")
    canary.save(tmp_path / "canary.npz")
    rc = main(["compare", "--base", str(tmp_path / "base"), "--candidate", str(tmp_path / "cand"), "--quiet",
               "--canary", str(tmp_path / "canary.npz"), "--out", str(tmp_path / "drift.json")])
    assert rc == 0
    kl = json.loads((tmp_path / "drift.json").read_text())["kl_base"]
    bounded, exact = kl["bounded"]["value"], kl["exact"]["value"]
    with capsys.disabled():
        print(f"\ntrained byte-level model, K=32 of 256: bounded {bounded:.6f}, exact {exact:.6f}, "
              f"gap {exact - bounded:.6f} ({(exact - bounded) / exact:.1%})")
    assert 0 < bounded <= exact + 1e-6
    assert exact - bounded <= BOUNDED_GAP * exact
    assert all(b <= e + 1e-6 for b, e in zip(kl["bounded"]["per_window"], kl["exact"]["per_window"]))
    assert "bounded=" in capsys.readouterr().out


def test_compare_says_when_the_exact_kl_is_not_computed(trained, tmp_path, capsys):
    base, cand, canary = trained
    base.save_pretrained(tmp_path / "base")
    cand.save_pretrained(tmp_path / "cand")
    canary.save(tmp_path / "canary.npz")
    assert main(["compare", "--base", str(tmp_path / "base"), "--candidate", str(tmp_path / "cand"), "--quiet",
                 "--canary", str(tmp_path / "canary.npz"), "--out", str(tmp_path / "d.json"), "--no-exact-kl"]) == 0
    assert "exact: not computed (--no-exact-kl was given)" in capsys.readouterr().out


def test_baseline_with_log_probs_round_trips_bit_for_bit(baseline, tmp_path):
    again = Baseline.load(baseline.save(tmp_path / "b"))
    for key in ("kl.logp", "kl.index", "kl.log_rest"):
        assert again.tensors[key].dtype == baseline.tensors[key].dtype
        assert torch.equal(again.tensors[key], baseline.tensors[key])
    assert again.tensors["kl.logp"].shape == (N_WINDOWS, WINDOW - 1, 32)
    assert again.tensors["kl.index"].dtype == torch.int32 and again.tensors["kl.log_rest"].dtype == torch.float32
    assert again.manifest["kl"] == {"top_k": 32, "vocab_size": 256}


def test_old_baseline_without_log_probs_loads_and_reports_kl_absent(trained, baseline, tmp_path):
    base, _, canary = trained
    old = Baseline({k: v for k, v in baseline.manifest.items() if k != "kl"},
                   {k: v for k, v in baseline.tensors.items() if not k.startswith("kl.")})
    loaded = Baseline.load(old.save(tmp_path / "old"))
    d = measure(base, canary, baseline=loaded, config=CFG).drift
    assert d["kl_base"] is None and d["kl_base_ci"] is None
    assert "saved without the base model's top-K log-probabilities" in d["kl_base_absent"]
    assert d["canary_nll_delta"] == 0.0


def test_kl_top_k_zero_keeps_none_and_says_so(trained):
    base, _, canary = trained
    cfg = AtlasConfig.from_dict({"receipts": {**CFG.to_dict()["receipts"], "kl_top_k": 0}})
    off = Baseline.from_report(measure(base, canary, config=cfg))
    assert not any(k.startswith("kl.") for k in off.tensors)
    d = measure(base, canary, baseline=off, config=cfg).drift
    assert d["kl_base"] is None and "kl_top_k was 0" in d["kl_base_absent"]
    with pytest.raises(ConfigError, match="kl_top_k"):
        AtlasConfig.from_dict({"receipts": {"kl_top_k": -1}})


def test_vocabulary_mismatch_names_both_sizes(trained, baseline):
    _, _, canary = trained
    other = _model(vocab=300)  # same routed layers, a wider vocabulary
    with pytest.raises(BaselineError, match="over 256 tokens, this model's logits over 300"):
        measure(other, canary, baseline=baseline, config=CFG)


def test_nan_logits_do_not_crash_the_gate(trained, baseline):
    base, _, canary = trained
    broken = copy.deepcopy(base)
    with torch.no_grad():
        broken.lm_head.weight[3] = float("nan")
    report = measure(broken, canary, baseline=baseline, config=CFG)
    assert report.drift["kl_base"] is None and report.drift["canary_nll_delta"] is None
    rec = gate_record(report, None, step=1, loss=None)
    assert "atlas/kl_base" not in gate_metrics(rec)
    json.loads(report.to_json())


def test_two_simulated_ranks_give_the_same_kl_and_top_k(trained, baseline):
    _, cand, canary = trained
    layers = find_routed_layers(cand)
    reports = []
    for world in (1, 2):
        parts = [measure_partial(cand, canary, CFG, layers, r, world, baseline=baseline, collect=True,
                                 anchors=None) for r in range(world)]
        report = build_report(parts, layers, canary, CFG, cand, None)
        attach_drift(report, baseline)
        reports.append((report, [p["topk"] for p in parts]))
    (one, _), (two, _) = reports
    # two ranks split the windows into other micro-batches than one rank does: a batch layout of its own, so
    # the numbers agree within the world-size tolerance (atlas_tracking.testing.tolerance), not bit for bit
    assert np.allclose(one.per_window["kl_base"]["sum"], two.per_window["kl_base"]["sum"], rtol=0, atol=FLOAT_TOL)
    assert one.per_window["kl_base"]["count"].tolist() == two.per_window["kl_base"]["count"].tolist()
    assert abs(one.drift["kl_base"] - two.drift["kl_base"]) <= FLOAT_TOL
    from atlas_tracking.engine.measure import merge_topk

    a, b = (merge_topk(parts, N_WINDOWS, 32) for _, parts in reports)
    for key in ("logp", "log_rest"):
        assert torch.allclose(a[key], b[key], rtol=0, atol=FLOAT_TOL), key
    # the top-K indices agree wherever the ranking is not a near-tie: both neighbouring log-probabilities lie
    # further apart than the tolerance (the K-th, whose follower is not kept, is left out)
    gaps = a["logp"].diff(dim=-1).abs() > FLOAT_TOL
    clear = torch.cat([gaps[..., :1], gaps[..., 1:] & gaps[..., :-1]], dim=-1)
    assert clear.float().mean() > 0.9
    assert torch.equal(a["index"][..., :-1][clear], b["index"][..., :-1][clear])


def test_verify_recomputes_kl_base_and_accepts_artifacts_from_before_it(trained, baseline):
    _, cand, canary = trained
    data = json.loads(measure(cand, canary, baseline=baseline, config=CFG).to_json())
    assert verify(data) == []
    tampered = copy.deepcopy(data)
    tampered["per_window"]["kl_base"]["sum"][0] += 0.5
    assert any(p.startswith("drift: kl_base is") for p in verify(tampered))
    older = copy.deepcopy(data)
    for key in ("kl_base", "kl_base_ci", "canary_nll_delta", "canary_nll_delta_ci"):
        del older["drift"][key]
    del older["per_window"]["kl_base"]
    assert verify(older) == []
