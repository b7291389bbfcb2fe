"""Router-expert coupling (docs/receipts.md#router-expert-coupling) against plain numpy loops, on every routing kind:
softmax (Qwen3-MoE), sigmoid with a correction bias in groups (DeepSeek-V3), top-1 (Qwen3-MoE at k = 1),
zero-computation experts (LongCat-Flash) and a LayerNorm block with a bias (PhiMoE).

Alignment is read from a gate; co-movement from a gate against a baseline after every router row and every expert's
weights were moved by seeded noise; both are compared with loops over tokens and experts that read the hooks of a
forward of their own. A frozen model compares nothing and says so; ``verify`` catches a tampered value.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from atlas_tracking import Baseline, Canary, measure
from atlas_tracking.artifacts.gate_report import verify
from atlas_tracking.receipts import coupling
from atlas_tracking.receipts.stats import bootstrap_indices
from atlas_tracking.testing.families import CFG, capture_layers, family_model
from atlas_tracking.testing.numpy_reference import comove_loop, coupling_loop

CANARY = Canary.from_token_ids(np.arange(600) * 7 % 64, window=16, n_windows=4, seed=0)
KINDS = {
    "softmax": ("qwen3_moe", {}),
    "sigmoid with bias": ("deepseek_v3", {}),
    "top-1": ("qwen3_moe", {"num_experts_per_tok": 1}),
    "zero-computation experts": ("longcat_flash", {}),
    "LayerNorm": ("phimoe", {}),
}
TOL = 1e-5
"""float32 sums in the gate against float64 loops."""
COMOVE_TOL = 1e-3
"""A cosine of two changes: float32 rounding of the means (stored at float32) is relative to the change, not to the
mean, so the changes of a step of training lose about three digits more than the means."""


def loop_coupling(model) -> list[dict[str, list]]:
    """Per routed layer, :func:`coupling_loop` on what one forward of the whole canary's hooks saw."""
    layers, seen = capture_layers(model, torch.as_tensor(CANARY.windows))
    out = []
    for lay in layers:
        d = seen[lay.name]
        g = d["g"].reshape(-1, d["g"].shape[-1])
        routing = lay.routing(d["router"], g)
        with torch.no_grad():
            u = lay.expert_outputs(g, routing.active).double().numpy()
        active = routing.active.numpy()
        carries = ~np.isin(active, sorted(lay.zero_experts))
        weight = lay.router_rows().double().numpy()
        out.append(coupling_loop(d["x"].reshape(len(g), -1).double().numpy(), active, weight,
                                 lay.gamma().detach().double().numpy(), lay.norm_type == "layernorm", u, carries))
    return out


def same(got: list, want: list, tol: float = TOL) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a is None) == (b is None), (got, want)
        if a is not None:
            assert abs(a - b) < tol, (got, want)


def moved(model, seed: int, scale: float = 0.05):
    """A copy with every router row and every expert weight moved by seeded noise of relative size ``scale``."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if any(part in name for part in ("gate", "router", "experts")) and p.dim() >= 2:
                p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=gen))
    return other


@pytest.fixture(scope="module", params=list(KINDS), ids=list(KINDS))
def kind(request):
    family, overrides = KINDS[request.param]
    return request.param, family_model(family, **overrides)


def test_alignment_matches_a_numpy_loop(kind):
    _, model = kind
    report = measure(model, CANARY, config=CFG)
    assert verify(report.to_dict()) == []
    for layer, ref in zip(report.layers, loop_coupling(model)):
        r = layer["receipts"]
        same(r["alignment"], ref["alignment"])
        finite = [a for a in ref["alignment"] if a is not None]
        assert abs(r["alignment_median"] - float(np.median(finite))) < TOL
        assert abs(r["alignment_p10"] - float(np.quantile(finite, 0.1))) < TOL
        assert r["alignment_negative"] == sum(a < 0 for a in finite) / len(finite)
        assert r["alignment_dead"] == [e for e, a in enumerate(ref["alignment"]) if a is None]
        lo, hi = layer["ci"]["alignment_median"]
        assert lo <= hi and all(-1.0 <= a <= 1.0 for a in finite)


def test_comovement_matches_a_numpy_loop(kind):
    name, model = kind
    base = Baseline.from_report(measure(model, CANARY, config=CFG))
    later = moved(model, seed=3)
    report = measure(later, CANARY, baseline=base, config=CFG)
    assert verify(report.to_dict()) == []
    for d, ref0, ref1 in zip(report.drift["layers"], loop_coupling(model), loop_coupling(later)):
        for part in coupling.COMOVE_PARTS:
            want = comove_loop(ref1, ref0, part)
            same(d[f"comove_{part}_experts"], want, COMOVE_TOL)
            finite = [c for c in want if c is not None]
            assert d[f"comove_{part}_compared"] == len(finite)
            if finite:
                assert abs(d[f"comove_{part}"] - float(np.median(finite))) < COMOVE_TOL
                clear = [c for c in finite if abs(c) > COMOVE_TOL]  # a sign within rounding of 0 could read either way
                got = [c for c in d[f"comove_{part}_experts"] if c is not None and abs(c) > COMOVE_TOL]
                assert sum(c < 0 for c in got) == sum(c < 0 for c in clear)
        if name == "zero-computation experts":  # identity slots carry no field: never compared
            zero = [8, 9]
            assert all(d["comove_field_experts"][e] is None for e in zero)
        assert d["comove_router_still"] == 0


def test_a_frozen_model_compares_nothing_and_says_so():
    model = family_model("qwen3_moe")
    base = Baseline.from_report(measure(model, CANARY, config=CFG))
    report = measure(model, CANARY, baseline=base, config=CFG)
    assert verify(report.to_dict()) == []
    for d in report.drift["layers"]:
        assert d["comove_router_still"] == 6 and d["comove_state_still"] == 6 and d["comove_field_still"] == 6
        assert d["comove_state"] is None and d["comove_state_compared"] == 0
        assert d["comove_state_experts"] == [None] * 6  # never a cosine of zero vectors
    assert report.drift["comove_router_still"] == 12 and report.drift["comove_compared"] == 0


def test_verify_recomputes_coupling_and_catches_tampering():
    model = family_model("qwen3_moe")
    base = Baseline.from_report(measure(model, CANARY, config=CFG))
    data = measure(moved(model, seed=5), CANARY, baseline=base, config=CFG).to_dict()
    assert verify(data) == []
    for tamper, expected in [
        (lambda x: x["layers"][0]["receipts"].__setitem__("alignment_median", 0.9), "alignment_median"),
        (lambda x: x["layers"][1]["ci"].__setitem__("alignment_negative", [0.2, 0.6]), "CI of alignment_negative"),
        (lambda x: x["per_window"]["layers"][0]["alignment"]["dot"][0].__setitem__(2, 5.0), "alignment"),
        (lambda x: x["drift"]["layers"][0].__setitem__("comove_state", 0.5), "comove_state"),
        (lambda x: x["drift"].__setitem__("comove_field", -0.5), "comove_field"),
    ]:
        bad = copy.deepcopy(data)
        tamper(bad)
        problems = verify(bad)
        assert problems and any(expected in p for p in problems), (expected, problems)


def test_alignment_receipts_against_loops():
    """The layer figures and their window-bootstrap CIs from per-window dots and loads, by loops over resamples."""
    rng = np.random.default_rng(0)
    w, e = 6, 5
    load = rng.integers(0, 4, size=(w, e))
    load[:, 4] = 0  # a dead expert
    dot = rng.normal(size=(w, e)) * load
    res = [0.8, 0.5, 0.9, 0.7, None]
    idx = bootstrap_indices(w, 40, 0)
    vals, cis = coupling.alignment_receipts({"dot": dot, "resultant": res, "row_norm": [1.0] * e}, load, idx, 0.95)
    assert vals["alignment_dead"] == [4] and vals["alignment"][4] is None
    medians = []
    for b in range(len(idx)):
        a = []
        for x in range(4):
            n = sum(load[i, x] for i in idx[b])
            if n:
                a.append(sum(dot[i, x] for i in idx[b]) / n / res[x])
        medians.append(float(np.median(a)) if a else np.nan)
    lo, hi = np.quantile([m for m in medians if np.isfinite(m)], [0.025, 0.975])
    assert abs(cis["alignment_median"][0] - lo) < 1e-12 and abs(cis["alignment_median"][1] - hi) < 1e-12
    want = [sum(dot[:, x]) / sum(load[:, x]) / res[x] for x in range(4)]
    assert abs(vals["alignment_median"] - float(np.median(want))) < 1e-12
