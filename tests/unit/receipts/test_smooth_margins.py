"""Proposition 3 of the MoE-atlas report (docs/receipts.md#smooth-margins): the smooth lifecycle margins converge to the exact ones as every beta grows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atlas_tracking.receipts import smooth
from atlas_tracking.receipts.drift import content_ratio
from atlas_tracking.receipts.lifecycle import handoff_margin, refine_margin
from atlas_tracking.receipts.state2 import c2_per_token

N, E, K, D, LAYERS = 300, 6, 2, 8, 3
BETA_ADJ, EPS = 1.0, 1e-12


def _layer(gen: torch.Generator) -> dict[str, torch.Tensor]:
    scores = torch.randn(N, E, generator=gen, dtype=torch.float64)
    probs = torch.softmax(scores, dim=1)
    v_all = torch.randn(N, E, D, generator=gen, dtype=torch.float64)
    scores1 = scores + 0.3 * torch.randn(N, E, generator=gen, dtype=torch.float64)
    u0 = torch.randn(N, K, D, generator=gen, dtype=torch.float64)
    u1 = u0 + 0.5 * torch.randn(N, K, D, generator=gen, dtype=torch.float64)
    return {"s": scores, "p": probs, "v": v_all, "s1": scores1, "u0": u0, "u1": u1}


def _exact(layer: dict[str, torch.Tensor]) -> dict[str, float]:
    s, p, v = layer["s"], layer["p"], layer["v"]
    active = s.topk(K, dim=1).indices
    rho = p.gather(1, active)
    rho = rho / rho.sum(1, keepdim=True)
    va = v.gather(1, active.unsqueeze(-1).expand(-1, -1, D))
    c2, _ = c2_per_token(va, rho, s.gather(1, active), BETA_ADJ, EPS)
    loads = torch.zeros(E, dtype=torch.float64).index_add_(0, active.reshape(-1), torch.ones(N * K, dtype=torch.float64))
    active1 = layer["s1"].topk(K, dim=1).indices
    hits = (active.unsqueeze(2) == active1.unsqueeze(1)).any(2).sum(1)
    cd = torch.quantile(content_ratio(layer["u1"], layer["u0"], EPS), 0.9, dim=1)
    pi_min1 = float((torch.zeros(E, dtype=torch.float64).index_add_(
        0, active1.reshape(-1), torch.ones(N * K, dtype=torch.float64)) / N).min())
    return {
        "c2": float(c2.mean()), "pi_min": float((loads / N).min()), "pi_min_now": pi_min1,
        "boundary_drift": float((1 - hits.double() / K).mean()), "content_drift": float(cd.mean()),
    }


def _smooth(layer: dict[str, torch.Tensor], beta: float) -> dict[str, torch.Tensor]:
    return {
        "c2": smooth.smooth_c2(layer["v"], layer["p"], layer["s"], K, beta, BETA_ADJ, EPS),
        "pi_tail": smooth.smooth_pi_tail(layer["s"], K, beta, beta),
        "pi_tail_now": smooth.smooth_pi_tail(layer["s1"], K, beta, beta),
        "boundary": smooth.smooth_boundary_drift(layer["s"], layer["s1"], K, beta),
        "content": smooth.smooth_content_drift(content_ratio(layer["u1"], layer["u0"], EPS), 0.9, beta),
    }


@pytest.fixture(scope="module")
def layers() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [_layer(gen) for _ in range(LAYERS)]


def _exact_margins(layers: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
    ex = [_exact(layer) for layer in layers]
    ref = [{"c2": e["c2"] + 0.02 * i, "pi_min": e["pi_min"] * 1.1} for i, e in enumerate(ex)]
    now = [{"c2": e["c2"], "pi_min": e["pi_min"]} for e in ex]
    h, _ = handoff_margin(now, ref, list(range(LAYERS)), 1.0, 0.1, N)
    now_r = [{"pi_min": e["pi_min_now"]} for e in ex]
    base_r = [{"pi_min": e["pi_min"]} for e in ex]
    r, _ = refine_margin(now_r, ex, base_r, list(range(LAYERS)), (1.0, 1.0, 0.1), 0.25, N)
    return h, r


def _smooth_margins(layers: list[dict[str, torch.Tensor]], beta: float) -> tuple[float, float]:
    sm = [_smooth(layer, beta) for layer in layers]
    ex = [_exact(layer) for layer in layers]
    c2 = torch.stack([x["c2"] for x in sm])
    c2_ref = torch.tensor([e["c2"] + 0.02 * i for i, e in enumerate(ex)], dtype=torch.float64)
    pi = torch.stack([x["pi_tail"] for x in sm])
    pi_ref = pi.detach() * 0 + torch.tensor([e["pi_min"] * 1.1 for e in ex], dtype=torch.float64)
    h = smooth.smooth_handoff_margin(c2, c2_ref, pi, pi_ref, 1.0, 0.1, beta, N)
    r = smooth.smooth_refine_margin(
        torch.stack([x["boundary"] for x in sm]), torch.stack([x["content"] for x in sm]),
        torch.stack([x["pi_tail_now"] for x in sm]), pi, (1.0, 1.0, 0.1), 0.25, beta, N,
    )
    return float(h), float(r)


def test_smooth_margins_converge_to_exact(layers):
    h_ex, r_ex = _exact_margins(layers)
    errors = []
    for beta in (1e1, 1e2, 1e3, 1e5, 1e7):
        h, r = _smooth_margins(layers, beta)
        errors.append((abs(h - h_ex), abs(r - r_ex)))
    h_err, r_err = np.array(errors).T
    assert h_err[-1] < 1e-5 and r_err[-1] < 1e-5, errors
    assert h_err[0] > 10 * h_err[-1] and r_err[0] > 10 * r_err[-1], errors
    assert np.sign(_smooth_margins(layers, 1e7)[0]) == np.sign(h_ex)


def test_smooth_quantile_matches_torch_quantile():
    x = torch.tensor([[0.1, 0.9, 0.4, 0.7]], dtype=torch.float64)
    for q in (0.0, 0.5, 0.9, 1.0):
        assert abs(float(smooth.smooth_quantile(x, q, 1e6)) - float(torch.quantile(x, q, dim=1))) < 1e-5


def test_soft_membership_excludes_ineligible():
    s = torch.tensor([[2.0, float("-inf"), 1.0, 0.5]], dtype=torch.float64)
    m = smooth.soft_membership(s, k=2, beta=1e4)
    assert m.tolist() == [[1.0, 0.0, 1.0, 0.0]]
