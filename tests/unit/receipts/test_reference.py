"""Every pure receipt function against an independent plain-numpy-loop reference, plus closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atlas_tracking.receipts import consistency, geometry, nll, occupancy, state1, state2, stats, windows
from atlas_tracking.testing.numpy_reference import c2_loop

SEEDS = (0, 1, 2)


def _rng(seed):
    return np.random.default_rng(seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_rms_normalize_and_tangent_projection(seed):
    x = _rng(seed).normal(size=(7, 12)) * 3
    z = geometry.rms_normalize(torch.tensor(x), eps=1e-6).numpy()
    for t in range(7):
        r = math.sqrt(sum(v * v for v in x[t]) / 12 + 1e-6)
        assert np.allclose(z[t], x[t] / r, atol=1e-5)
    zh = geometry.angular(torch.tensor(z, dtype=torch.float32))
    u = torch.tensor(_rng(seed + 10).normal(size=(7, 3, 12)), dtype=torch.float32)
    v = geometry.tangent_project(u, zh).numpy()
    for t in range(7):
        for m in range(3):
            zt = zh[t].numpy()
            ref = u[t, m].numpy() - float(np.dot(zt, u[t, m].numpy())) * zt
            assert np.allclose(v[t, m], ref, atol=1e-5)
            assert abs(float(np.dot(v[t, m], zt))) < 1e-5  # closed form: v is orthogonal to z


@pytest.mark.parametrize("seed", SEEDS)
def test_tangent_gram_and_c2_from_gram(seed):
    """The gate's path (Gram of the tangent fields from u and zh) against loops over v."""
    rng = _rng(seed)
    u = rng.normal(size=(6, 4, 10)) + 2.0 * rng.normal(size=(6, 1, 10))  # fields with a shared radial part
    zh = rng.normal(size=(6, 10))
    zh /= np.linalg.norm(zh, axis=1, keepdims=True)
    gram = state2.tangent_gram(torch.tensor(u), torch.tensor(zh)).numpy()
    rho = rng.random((6, 4))
    rho /= rho.sum(1, keepdims=True)
    s = rng.normal(size=(6, 4))
    c2, ok = state2.c2_from_gram(torch.tensor(gram), torch.tensor(rho), torch.tensor(s), 0.7, 1e-9)
    for t in range(6):
        v = [u[t, m] - float(np.dot(u[t, m], zh[t])) * zh[t] for m in range(4)]
        num = den = 0.0
        for a in range(4):
            for b in range(4):
                assert abs(gram[t, a, b] - float(np.dot(v[a], v[b]))) < 1e-9
                if a != b:
                    w = rho[t, a] * rho[t, b] * math.exp(-0.7 * abs(s[t, a] - s[t, b]))
                    num += w * float(np.dot(v[a], v[b])) / (np.linalg.norm(v[a]) * np.linalg.norm(v[b]) + 1e-9)
                    den += w
        assert abs(float(c2[t]) - num / den) < 1e-9 and bool(ok[t])


@pytest.mark.parametrize("seed", SEEDS)
def test_kappa_pairs_and_c2(seed):
    rng = _rng(seed)
    v = rng.normal(size=(5, 3, 8))
    rho = rng.random((5, 3))
    rho /= rho.sum(1, keepdims=True)
    s = rng.normal(size=(5, 3))
    kap = state2.kappa_matrix(torch.tensor(v), 1e-9).numpy()
    c2, ok = state2.c2_per_token(torch.tensor(v), torch.tensor(rho), torch.tensor(s), 0.7, 1e-9)
    for t in range(5):
        num, den = 0.0, 0.0
        for a in range(3):
            for b in range(3):
                ref = np.dot(v[t, a], v[t, b]) / (np.linalg.norm(v[t, a]) * np.linalg.norm(v[t, b]) + 1e-9)
                assert abs(kap[t, a, b] - ref) < 1e-9 and -1 - 1e-12 <= kap[t, a, b] <= 1 + 1e-12
                if a != b:
                    w = rho[t, a] * rho[t, b] * math.exp(-0.7 * abs(s[t, a] - s[t, b]))
                    num += w * ref
                    den += w
        assert abs(float(c2[t]) - num / den) < 1e-9 and bool(ok[t])
    w = state2.pair_weights(torch.tensor(rho), torch.tensor(s), 0.7).numpy()
    assert np.allclose(w.sum((1, 2)), 1.0) and np.allclose(np.diagonal(w, axis1=1, axis2=2), 0.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_c2_leaves_zero_computation_experts_out_of_the_pairs(seed):
    """Pairs with a zero-computation expert weigh 0, the rest renormalised; under two field-carrying experts, no pair."""
    rng = _rng(seed)
    v = rng.normal(size=(8, 4, 6))
    rho = rng.random((8, 4))
    rho /= rho.sum(1, keepdims=True)
    s = rng.normal(size=(8, 4))
    carries = rng.random((8, 4)) > 0.4
    carries[0] = [True, False, False, False]  # one field-carrying expert: no pair
    c2, ok = state2.c2_per_token(torch.tensor(v), torch.tensor(rho), torch.tensor(s), 0.7, 1e-9, torch.tensor(carries))
    for t, ref in enumerate(c2_loop(v, None, rho, s, 0.7, 1e-9, carries)):
        if ref is None:
            assert not bool(ok[t])
        else:
            assert bool(ok[t]) and abs(float(c2[t]) - ref) < 1e-9


def test_c2_needs_a_pair():
    _, ok = state2.c2_per_token(torch.ones(2, 1, 4), torch.ones(2, 1), torch.zeros(2, 1), 1.0, 1e-8)
    assert not ok.any()


@pytest.mark.parametrize("seed", SEEDS)
def test_redundancy_distance_and_swap_jump(seed):
    rng = _rng(seed)
    va, vb = rng.normal(size=(6, 5)), rng.normal(size=(6, 5))
    d = state2.redundancy_distance(torch.tensor(va), torch.tensor(vb), 1e-9).numpy()
    for t in range(6):
        ref = np.linalg.norm(va[t] - vb[t]) / (np.linalg.norm(va[t]) + np.linalg.norm(vb[t]) + 1e-9)
        assert abs(d[t] - ref) < 1e-12 and 0 <= d[t] <= 1
    v = rng.normal(size=(6, 3, 5))
    rho = rng.random((6, 3))
    rho /= rho.sum(1, keepdims=True)
    pos = rng.integers(0, 3, 6)
    vk1 = rng.normal(size=(6, 5))
    j = state2.swap_jump(torch.tensor(v), torch.tensor(rho), torch.tensor(pos), torch.tensor(vk1)).numpy()
    for t in range(6):
        field = sum(rho[t, e] * v[t, e] for e in range(3))
        ref = np.linalg.norm(rho[t, pos[t]] * (vk1[t] - v[t, pos[t]])) / np.linalg.norm(field)
        assert abs(j[t] - ref) < 1e-9


@pytest.mark.parametrize("seed", SEEDS)
def test_set_margin_with_ineligible_experts(seed):
    rng = _rng(seed)
    scores = rng.normal(size=(8, 6))
    scores[0, :] = -np.inf
    scores[0, :2] = [1.0, 0.5]  # exactly k eligible: no competitor
    scores[1, 4] = -np.inf
    active = np.argsort(-scores, axis=1)[:, :2]
    m = state1.set_margin(torch.tensor(scores), torch.tensor(active))
    for t in range(8):
        sel = set(active[t].tolist())
        e_k = min(sel, key=lambda e: scores[t, e])
        rest = [(scores[t, e], e) for e in range(6) if e not in sel and np.isfinite(scores[t, e])]
        if not rest:
            assert not bool(m.valid[t])
            continue
        best, e_k1 = max(rest)
        assert bool(m.valid[t]) and int(m.e_k[t]) == e_k and int(m.e_k1[t]) == e_k1
        assert abs(float(m.margin[t]) - (scores[t, e_k] - best)) < 1e-12 and float(m.margin[t]) >= 0


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.floats(0.01, 1.0), st.integers(0, 10_000))
def test_boundary_set_takes_ceil_q_t_smallest(length, q, seed):
    rng = _rng(seed)
    margins = rng.random((3, length))
    valid = rng.random((3, length)) > 0.2
    mask = state1.boundary_set(torch.tensor(margins), torch.tensor(valid), q).numpy()
    for w in range(3):
        t_w = int(valid[w].sum())
        n_b = math.ceil(q * t_w - 1e-9)
        order = sorted((margins[w, i], i) for i in range(length) if valid[w, i])
        expected = {i for _, i in order[:n_b]}
        assert {i for i in range(length) if mask[w, i]} == expected
        if t_w:
            assert state1.q_eff(t_w, q) == n_b / t_w


def test_q_eff_float_case():
    assert state1.boundary_count(30, 0.1) == 3 and state1.q_eff(30, 0.1) == 0.1
    assert state1.q_eff(25, 0.1) == 0.12  # the null is not q


@pytest.mark.parametrize("seed", SEEDS)
def test_occupancy_cells_and_overlap(seed):
    rng = _rng(seed)
    n_tok, n_exp, k = 50, 7, 2
    active = np.stack([rng.choice(n_exp, size=k, replace=False) for _ in range(n_tok)])
    win = np.repeat(np.arange(5), 10)
    loads = occupancy.window_loads(torch.tensor(active), 5, n_exp).numpy()  # window-major: 10 tokens each
    for w in range(5):
        for e in range(n_exp):
            assert loads[w, e] == sum(1 for t in range(n_tok) if win[t] == w and e in active[t])
    total = loads.sum(0)
    probs = rng.random((n_tok, n_exp))
    probs /= probs.sum(1, keepdims=True)
    occ = occupancy.occupancy_from_loads(total, n_tok, probs.sum(0), beta_pi=1e6)
    assert occ["dead_experts"] + occ["experts_active"] == n_exp
    assert abs(occ["pi_sum"] - k) < 1e-12  # sum_e pi_e = k
    mean = sum(total) / n_exp
    std = math.sqrt(sum((x - mean) ** 2 for x in total) / n_exp)  # population std
    assert abs(occ["load_cv"] - std / mean) < 1e-12
    f = [x / sum(total) for x in total]
    ent = -sum(p * math.log(p) for p in f if p > 0)
    assert abs(occ["router_entropy"] - ent) < 1e-12 and ent <= math.log(n_exp) + 1e-12
    assert abs(occ["pi_min"] - min(total) / n_tok) < 1e-12
    assert abs(occ["pi_tail_smooth"] - probs.mean(0).min()) < 1e-4
    ref: dict = {}
    for row in active:
        key = tuple(sorted(row.tolist()))
        ref[key] = ref.get(key, 0) + 1
    for n_experts in (n_exp, 2**40):  # integer keys, and sorted rows when E^k does not fit
        keys = occupancy.cell_keys(torch.tensor(active), n_experts)
        cells, counts = occupancy.count_cells(occupancy.sorted_cell_keys(keys).numpy())
        assert sorted(counts.tolist()) == sorted(ref.values()) and len(cells) == len(ref)
    cs = occupancy.cell_stats(np.array(list(ref.values())))
    mu = [c / n_tok for c in ref.values()]
    assert cs["cells_visited"] == len(ref) and abs(cs["cell_entropy"] + sum(p * math.log(p) for p in mu)) < 1e-12
    other = np.stack([rng.choice(n_exp, size=k, replace=False) for _ in range(n_tok)])
    ov = consistency.set_overlap(torch.tensor(active), torch.tensor(other), n_exp).numpy()
    for t in range(n_tok):
        assert ov[t] == len(set(active[t]) & set(other[t])) / k


def test_smin_smax():
    a = np.array([0.3, 0.1, 0.2])
    assert abs(occupancy.smin(a, 1e4) - 0.1) < 1e-3 and abs(occupancy.smax(a, 1e4) - 0.3) < 1e-3
    ref = -math.log(sum(math.exp(-2 * x) for x in a)) / 2
    assert abs(occupancy.smin(a, 2.0) - ref) < 1e-12


def test_window_nll_reference():
    rng = _rng(0)
    logits = rng.normal(size=(2, 5, 7))
    ids = rng.integers(0, 7, (2, 5))
    s, n = nll.window_nll(torch.tensor(logits, dtype=torch.float32), torch.tensor(ids))
    for w in range(2):
        ref = 0.0
        for t in range(4):
            row = logits[w, t]
            ref += -(row[ids[w, t + 1]] - math.log(sum(math.exp(x) for x in row)))
        assert abs(float(s[w]) - ref) < 1e-4 and int(n[w]) == 4


def test_bootstrap_helpers_reference():
    sums, counts = np.array([1.0, 2.0, 5.0, 0.0]), np.array([2.0, 2.0, 4.0, 0.0])
    idx = stats.bootstrap_indices(4, 500, seed=7)
    assert stats.ratio(sums, counts) == 8.0 / 8.0
    reps = [sum(sums[i] for i in row) / sum(counts[i] for i in row) if sum(counts[i] for i in row) else math.nan
            for row in idx]
    reps = np.array([r for r in reps if not math.isnan(r)])
    lo, hi = stats.ratio_ci(sums, counts, idx, 0.9)
    assert abs(lo - np.quantile(reps, 0.05)) < 1e-12 and abs(hi - np.quantile(reps, 0.95)) < 1e-12
    b_s, b_c = np.array([1.0, 1.0, 1.0, 1.0]), np.ones(4)
    dlo, dhi = stats.diff_ci(sums, counts, b_s, b_c, idx, 0.9)
    dreps = []
    for row in idx:
        c = sum(counts[i] for i in row)
        if c:
            dreps.append(sum(sums[i] for i in row) / c - 1.0)
    assert abs(dlo - np.quantile(dreps, 0.05)) < 1e-12 and abs(dhi - np.quantile(dreps, 0.95)) < 1e-12


def test_v2_axes_are_paired_differences_on_the_same_resamples():
    """``ratio_receipts`` with axes: ``a - b`` and its CI from resamples that re-count the same windows on both sides,
    a plain loop per resample; an axis with an empty side is None."""
    a_s, a_c = np.array([0.4, 0.9, 0.2, 0.6, 0.5]), np.array([1.0, 2.0, 1.0, 2.0, 1.0])
    b_s, b_c = np.array([1.5, 0.5, 2.0, 1.0, 0.5]), np.array([2.0, 1.0, 3.0, 2.0, 1.0])
    per_window = {"a": {"sum": a_s, "count": a_c}, "b": {"sum": b_s, "count": b_c},
                  "empty": {"sum": np.zeros(5), "count": np.zeros(5)}}
    idx = stats.bootstrap_indices(5, 400, seed=3)
    values, cis = windows.ratio_receipts(per_window, idx, 0.9, {"gap": ("a", "b"), "none": ("a", "empty")})
    reps = [sum(a_s[i] for i in row) / sum(a_c[i] for i in row) - sum(b_s[i] for i in row) / sum(b_c[i] for i in row)
            for row in idx]
    assert abs(values["gap"] - (a_s.sum() / a_c.sum() - b_s.sum() / b_c.sum())) < 1e-12
    assert np.allclose(cis["gap"], np.quantile(reps, [0.05, 0.95]), rtol=0, atol=1e-12)
    assert values["gap_pass"] == (np.quantile(reps, 0.95) < 0)
    assert values["none"] is None and cis["none"] == [None, None] and values["none_pass"] is None


@pytest.mark.parametrize("per_window", [
    [[0.5, 0.1], [0.9], [], [0.3, 0.7, 0.2]],  # 6 values: the median is the mean of the two middle ones
    [[0.5, 0.1], [0.9], [0.4], [0.3, 0.7, 0.2]],  # 7 values
    [[0.25, 0.25], [0.75], [0.1, 0.9, 0.5, 0.6]],
])
def test_median_receipt_reference(per_window):
    """The usual median (mean of the two middle order statistics), for the estimate and every resample."""
    idx = stats.bootstrap_indices(len(per_window), 300, seed=1)
    est, ci = windows.median_receipt(per_window, idx, 0.95)
    flat = sorted(v for w in per_window for v in w)
    half = len(flat) // 2
    assert est == (flat[half] if len(flat) % 2 else (flat[half - 1] + flat[half]) / 2)
    reps = []
    for row in idx:
        vals = sorted(v for i in row for v in per_window[i])
        if vals:
            h = len(vals) // 2
            reps.append(vals[h] if len(vals) % 2 else (vals[h - 1] + vals[h]) / 2)
    assert abs(ci[0] - float(np.quantile(reps, 0.025))) < 1e-12
    assert abs(ci[1] - float(np.quantile(reps, 0.975))) < 1e-12


@pytest.mark.parametrize("mu_shift,delta", [(0.0, 0.05), (0.3, 0.1), (-0.5, 0.02)])
def test_boundary_mass_of_a_linear_router_under_gaussian_input(mu_shift, delta):
    """The boundary-mass closed form (docs/receipts.md#state1-boundary): P(|a.x + b| <= delta) = Phi((delta-m)/s) - Phi((-delta-m)/s)."""
    rng = _rng(5)
    n = 200_000
    a = np.array([0.8, -0.5, 0.3, 0.1])
    b = mu_shift
    cov = np.diag([1.0, 0.5, 2.0, 1.5])
    mu = np.array([0.1, 0.2, -0.1, 0.0])
    x = rng.multivariate_normal(mu, cov, size=n)
    scores = torch.tensor(np.stack([x @ a + b, np.zeros(n)], axis=1))  # two experts, k = 1
    active = scores.argmax(1, keepdim=True)
    margin = state1.set_margin(scores, active).margin.numpy()
    empirical = float((margin <= delta).mean())
    m, s = float(a @ mu + b), math.sqrt(float(a @ cov @ a))

    def phi(z):
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))

    closed = phi((delta - m) / s) - phi((-delta - m) / s)
    assert abs(empirical - closed) < 4 * math.sqrt(closed * (1 - closed) / n) + 1e-4
    small = 2 * delta * math.exp(-0.5 * (m / s) ** 2) / (math.sqrt(2 * math.pi) * s)
    assert abs(closed - small) / small < 0.02  # the small-delta asymptotic (3.12)
