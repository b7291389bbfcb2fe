"""C2 stays a cosine for experts whose output is (nearly) parallel to their input (docs/receipts.md#precision).

Identity experts (``u = Gamma z``, LongCat-Flash's zero-computation slots with unit gains) and near-identity ones
(``u = c zh + delta t`` with a small tangent part ``delta``) in float32: the Gram matrix of the tangent fields is
positive semidefinite and satisfies Cauchy-Schwarz before any clamp, ``kappa`` and ``c2`` equal float64 loops over
the float32-projected fields at every ``delta`` (so the clamp to ``[-1, 1]`` hides no wrong value), and where the
tangent part is well above float32 rounding, or absent (exactly-identity experts: ``c2`` ~ 0), ``c2`` agrees with a
float64 loop over the fields projected in float64.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from atlas_tracking.receipts import state2
from atlas_tracking.receipts.geometry import tangent_project
from atlas_tracking.testing.numpy_reference import c2_loop


def _near_identity(seed: int, n: int, k: int, d: int, delta: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    zh = rng.normal(size=(n, d))
    zh /= np.linalg.norm(zh, axis=1, keepdims=True)
    scale = rng.uniform(0.5, 20.0, size=(n, k, 1))
    tangent = rng.normal(size=(n, k, d))
    u = scale * zh[:, None, :] + delta * scale * tangent
    return u, zh


def _kappa_loop(v: np.ndarray, eps: float) -> np.ndarray:
    """``kappa[t, a, b] = <v_a, v_b> / (||v_a|| ||v_b|| + eps)`` per token, as a float64 loop (no clamp)."""
    n, k, _ = v.shape
    out = np.zeros((n, k, k))
    for t in range(n):
        for a in range(k):
            for b in range(k):
                out[t, a, b] = np.dot(v[t, a], v[t, b]) / (np.linalg.norm(v[t, a]) * np.linalg.norm(v[t, b]) + eps)
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(2, 8), d=st.sampled_from([8, 64, 256]),
       log_delta=st.floats(-12.0, 0.0))
@example(seed=3, k=4, d=256, log_delta=-12.0)  # exactly-identity experts, always
@example(seed=5, k=8, d=8, log_delta=-12.0)
def test_c2_is_a_cosine_for_near_identity_and_identity_experts(seed, k, d, log_delta):
    delta = 0.0 if log_delta < -11.0 else 10.0 ** log_delta  # exactly-identity experts included
    u, zh = _near_identity(seed, 16, k, d, delta)
    u32, zh32 = torch.tensor(u, dtype=torch.float32), torch.tensor(zh, dtype=torch.float32)
    gram = state2.tangent_gram(u32, zh32).double()
    assert float(torch.linalg.eigvalsh(gram).min()) >= -1e-6 * float(gram.diagonal(dim1=1, dim2=2).abs().max() + 1e-30)
    norms = gram.diagonal(dim1=1, dim2=2)
    assert bool((norms >= 0).all())
    # Cauchy-Schwarz before any clamp: |<v_a, v_b>| <= ||v_a|| ||v_b|| up to float32 rounding of the products
    bound = (norms.unsqueeze(2) * norms.unsqueeze(1)).sqrt() * (1 + 1e-5 * d)
    assert bool((gram.abs() <= bound + 1e-30).all())
    # kappa's values against a float64 loop over the float32-projected fields, identity experts included, where
    # the clamp to [-1, 1] cannot make a wrong value look right
    v = tangent_project(u32, zh32).double().numpy()
    kappa = state2.kappa_from_gram(gram.float(), 1e-8)
    assert np.allclose(kappa.numpy(), _kappa_loop(v, 1e-8), atol=1e-4, rtol=0)
    rng = np.random.default_rng(seed + 1)
    rho = rng.random((16, k))
    rho /= rho.sum(1, keepdims=True)
    s = rng.normal(size=(16, k))
    c2, ok = state2.c2_from_gram(gram.float(), torch.tensor(rho, dtype=torch.float32),
                                 torch.tensor(s, dtype=torch.float32), 1.0, 1e-8)
    assert bool(ok.all())
    assert np.allclose(c2.numpy(), c2_loop(v, None, rho, s, 1.0, 1e-8), atol=1e-4, rtol=0)
    # the value itself: where the tangent part is well above float32 rounding of ||u||, and for exactly-identity
    # experts (no tangent part: eps_kappa keeps their rounding noise from reading as a cosine, c2 ~ 0)
    if delta >= 1e-3 or delta == 0.0:
        ref = c2_loop(u, zh, rho, s, 1.0, 1e-8)
        assert np.allclose(c2.numpy(), ref, atol=2e-3), (c2.numpy(), ref)


def test_subtracting_radial_parts_is_what_broke():
    """The form the Gram matrix is no longer computed in (``<u, u'> - a a'``) goes negative on identity experts in
    float32; projecting first does not."""
    u, zh = _near_identity(3, 64, 4, 256, 0.0)
    u32, zh32 = torch.tensor(u, dtype=torch.float32), torch.tensor(zh, dtype=torch.float32)
    a = torch.bmm(u32, zh32.unsqueeze(2))
    subtracted = torch.bmm(u32, u32.transpose(1, 2)) - a * a.transpose(1, 2)
    assert float(subtracted.diagonal(dim1=1, dim2=2).min()) < 0
    assert float(state2.tangent_gram(u32, zh32).diagonal(dim1=1, dim2=2).min()) >= 0
