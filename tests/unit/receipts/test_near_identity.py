"""C2 stays a cosine for experts whose output is (nearly) parallel to their input (docs/receipts.md#precision).

Identity experts (``u = Gamma z``, LongCat-Flash's zero-computation slots with unit gains) and near-identity ones
(``u = c zh + delta t`` with a small tangent part ``delta``) in float32: the Gram matrix of the tangent fields is
positive semidefinite, every ``kappa`` and every per-token ``c2`` lies in ``[-1, 1]``, and where the tangent part
is well above float32 rounding ``c2`` agrees with a float64 loop over the projected fields.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atlas_tracking.receipts import state2
from atlas_tracking.testing.numpy_reference import c2_loop


def _near_identity(seed: int, n: int, k: int, d: int, delta: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    zh = rng.normal(size=(n, d))
    zh /= np.linalg.norm(zh, axis=1, keepdims=True)
    scale = rng.uniform(0.5, 20.0, size=(n, k, 1))
    tangent = rng.normal(size=(n, k, d))
    u = scale * zh[:, None, :] + delta * scale * tangent
    return u, zh


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(2, 8), d=st.sampled_from([8, 64, 256]),
       log_delta=st.floats(-12.0, 0.0))
def test_c2_is_a_cosine_for_near_identity_and_identity_experts(seed, k, d, log_delta):
    delta = 0.0 if log_delta < -11.0 else 10.0 ** log_delta  # exactly-identity experts included
    u, zh = _near_identity(seed, 16, k, d, delta)
    u32, zh32 = torch.tensor(u, dtype=torch.float32), torch.tensor(zh, dtype=torch.float32)
    gram = state2.tangent_gram(u32, zh32).double()
    assert float(torch.linalg.eigvalsh(gram).min()) >= -1e-6 * float(gram.diagonal(dim1=1, dim2=2).abs().max() + 1e-30)
    assert bool((gram.diagonal(dim1=1, dim2=2) >= 0).all())
    kappa = state2.kappa_from_gram(gram.float(), 1e-8)
    assert bool(((kappa >= -1.0) & (kappa <= 1.0)).all())
    rng = np.random.default_rng(seed + 1)
    rho = rng.random((16, k))
    rho /= rho.sum(1, keepdims=True)
    s = rng.normal(size=(16, k))
    c2, ok = state2.c2_from_gram(gram.float(), torch.tensor(rho, dtype=torch.float32),
                                 torch.tensor(s, dtype=torch.float32), 1.0, 1e-8)
    assert bool(((c2 >= -1.0) & (c2 <= 1.0)).all()) and bool(ok.all())
    if delta >= 1e-3:  # tangent part well above float32 rounding of ||u||: the value itself is right
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
