"""The gate's per-token field arithmetic (docs/receipts.md#field-kernels): one function, held to a float64 numpy
loop written from the definitions; its compiled path held to its eager one; the path each layer took in the record,
and a compile that fails falling back to eager without failing the gate.

Tolerances (measured on these inputs): the function, in fp32, is within 5e-7 of the float64 loop (absolute, for
fp32 and bf16 fields alike: bf16 fields are read exactly, then computed in fp32); the compiled path reorders fp32
sums and is within 5.2e-7 of the eager one on a chunk and 9.5e-7 on a gate's per-window sums on a CPU. Both are
held to 1e-5 (absolute plus relative), a margin of 10 or more.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import atlas_tracking.testing.parallel_models as pm
from atlas_tracking import AtlasConfig, Canary, measure
from atlas_tracking.artifacts.gate_report import verify
from atlas_tracking.engine import kernels
from atlas_tracking.engine.kernels import PROCESS_KERNELS, ChunkKernels
from atlas_tracking.receipts.field_chunk import adjacent_receipts, chunk_receipts
from atlas_tracking.testing.distributed import run_workers
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.numpy_reference import c2_loop

TOL = 1e-5
BETA, EPS_KAPPA, EPS_D = 1.0, 1e-8, 1e-8
CANARY = Canary.from_token_ids(np.arange(400) * 7 % 64, window=16, n_windows=4, seed=0)


def chunk(n: int, k: int, d: int, n_experts: int, dtype: torch.dtype, seed: int = 0) -> tuple:
    """One chunk's inputs as a gate hands them over: fields in ``dtype``, the rest in fp32, a zero-computation
    expert (0, 1) at some slots."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(n, k + 1, d, generator=gen).to(dtype)
    zh = torch.nn.functional.normalize(torch.randn(n, d, generator=gen), dim=-1)
    rho = torch.rand(n, k, generator=gen) + 0.1
    rho = rho / rho.sum(1, keepdim=True)
    s_active = torch.rand(n, k, generator=gen)
    experts = torch.stack([torch.randperm(n_experts, generator=gen)[:k] for _ in range(n)])
    carriers = experts >= 2  # experts 0 and 1 carry no field
    pos_k = s_active.argmin(dim=1)
    rho_k = rho.gather(1, pos_k.view(-1, 1)).squeeze(1)
    return (u[:, :k], u[:, -1], zh, rho, s_active, carriers, pos_k, rho_k, BETA, EPS_KAPPA, EPS_D, experts, n_experts)


def float64_loop(u_active, u_adj, zh, rho, s_active, carriers, pos_k, rho_k, beta, eps_kappa, eps_d, experts,
                 n_experts) -> dict[str, np.ndarray]:
    """The receipts token by token in float64, from the definitions (docs/receipts.md#state2-co-active-overlap-
    compatibility, #v2-axes)."""
    u, ua, z = (np.asarray(t.double()) for t in (u_active, u_adj, zh))
    rho, s, car, exp = (np.asarray(t) for t in (rho.double(), s_active.double(), carriers, experts))
    n, k, d = u.shape
    c2 = c2_loop(u, z, rho, s, beta, eps_kappa, car)
    out = {"c2": np.array([0.0 if c is None else c for c in c2]), "c2_ok": np.array([c is not None for c in c2]),
           "v_k": np.zeros((n, d)), "d_adj": np.zeros(n), "jump": np.zeros(n), "field_sum": np.zeros((n_experts, d))}
    for t in range(n):
        v = [u[t, m] - float(np.dot(u[t, m], z[t])) * z[t] for m in range(k)]
        v_k, v_k1 = v[int(pos_k[t])], ua[t] - float(np.dot(ua[t], z[t])) * z[t]
        gap = float(np.linalg.norm(v_k - v_k1))
        field = sum(rho[t, m] * car[t, m] * v[m] for m in range(k))
        out["v_k"][t] = v_k
        out["d_adj"][t] = gap / (np.linalg.norm(v_k) + np.linalg.norm(v_k1) + eps_d)
        out["jump"][t] = float(rho_k[t]) * gap / max(float(np.linalg.norm(field)), math.ulp(0.0))
        for m in range(k):
            out["field_sum"][exp[t, m]] += v[m]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_receipts_is_the_float64_loop(dtype):
    args = chunk(40, 3, 16, 5, dtype)
    got = chunk_receipts(*args)
    want = float64_loop(*args)
    assert got.c2.dtype == got.v_k.dtype == got.jump.dtype == torch.float32
    assert torch.equal(got.c2_ok, torch.as_tensor(want["c2_ok"])) and not got.c2_ok.all()  # a token without a pair
    for key in ("c2", "v_k", "d_adj", "jump", "field_sum"):
        np.testing.assert_allclose(np.asarray(getattr(got, key)), want[key], rtol=TOL, atol=TOL, err_msg=key)
    assert chunk_receipts(*args[:-2]).field_sum is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_adjacent_part_later_is_the_same_arithmetic(dtype):
    """Without the adjacent field (pooled competitors) the chunk leaves the distance and jump to adjacent_receipts,
    which gives them from what the chunk kept: the one-pass values bit for bit, and the float64 loop's."""
    args = chunk(40, 3, 16, 5, dtype, seed=1)
    whole, first = chunk_receipts(*args), chunk_receipts(args[0], None, *args[2:])
    assert first.d_adj is None and first.jump is None and torch.equal(first.v_k, whole.v_k)
    d_adj, jump = adjacent_receipts(args[1], args[2], first.v_k, first.field, args[7], EPS_D)
    assert torch.equal(d_adj, whole.d_adj) and torch.equal(jump, whole.jump)
    want = float64_loop(*args)
    np.testing.assert_allclose(np.asarray(d_adj), want["d_adj"], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(np.asarray(jump), want["jump"], rtol=TOL, atol=TOL)


def test_auto_compiles_only_on_cuda_with_triton(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(kernels, "has_triton", lambda: True)
    assert [ChunkKernels().path("auto", dev) for dev in (cpu, cuda)] == ["eager", "compiled"]
    assert ChunkKernels().path("eager", cuda) == "eager"
    monkeypatch.setattr(kernels, "has_triton", lambda: False)
    assert ChunkKernels().path("auto", cuda) == "eager"


def gate(setting: str) -> dict:
    """The record of a gate of a tiny bf16 model with ``receipts.kernels: setting`` (checked by ``verify``)."""
    model = family_model("qwen3_moe", seed=3).to(torch.bfloat16)
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "n_bootstrap": 20, "batch_windows": 2,
                                              "kernels": setting}})
    data = measure(model, CANARY, config=cfg).to_dict()
    assert verify(data) == []
    return data


def test_auto_on_a_cpu_is_eager_and_the_record_says_so(monkeypatch):
    monkeypatch.setattr(PROCESS_KERNELS, "fallback", None)
    data = gate("auto")
    assert [lay["selfcheck"]["kernels"] for lay in data["layers"]] == ["eager"] * len(data["layers"])
    assert not any("kernels_fallback" in lay["selfcheck"] for lay in data["layers"])


@pytest.mark.parametrize("where", ["compile", "call"])
def test_a_failed_compile_falls_back_to_eager(monkeypatch, caplog, where):
    def failing(fn, **kwargs):
        if where == "compile":
            raise RuntimeError("no inductor here\nsecond line")

        def call(*args, **kw):
            raise RuntimeError("no inductor here\nsecond line")

        return call

    monkeypatch.setattr(torch, "compile", failing)
    monkeypatch.setattr(PROCESS_KERNELS, "compiled", None)
    monkeypatch.setattr(PROCESS_KERNELS, "fallback", None)
    data = gate("compiled")
    for lay in data["layers"]:
        assert lay["selfcheck"]["kernels"] == "eager"
        assert lay["selfcheck"]["kernels_fallback"] == "RuntimeError: no inductor here"
    assert sum("computes it eagerly" in r.getMessage() for r in caplog.records) == 1  # once per process
    assert data["per_window"] == gate("eager")["per_window"]  # the eager numbers


def test_every_process_that_fell_back_is_named_in_the_record():
    """Two processes as under DDP: the record's self-check names the compile failure of each process that computed
    its windows eagerly because of it, not only the reporting process's, and the same on every process."""
    failed = [[1], [0, 1], []]
    per_rank = run_workers(pm.kernels_fallback, 2, failed, timeout=300)
    assert per_rank[0] == per_rank[1]
    reason = "RuntimeError: no C++ compiler on rank {}".format
    for ranks, layers in zip(failed, per_rank[0]):
        assert all(lay["kernels"] == "eager" for lay in layers)
        want = "; ".join(f"rank {r}: {reason(r)}" for r in ranks) or None
        assert [lay.get("kernels_fallback") for lay in layers] == [want] * len(layers), ranks


def close(got, want, path: str = "") -> None:
    """Every number of ``got`` within ``TOL`` of ``want`` (nested dicts and lists of the record)."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for key in want:
            close(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list) and want and isinstance(want[0], (dict, list)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            close(g, w, f"{path}[{i}]")
    elif want is None or isinstance(want, (str, bool)):
        assert got == want, path
    else:
        np.testing.assert_allclose(np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64),
                                   rtol=TOL, atol=TOL, err_msg=path)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the compiler's own deprecations
def test_the_compiled_path_is_the_eager_one(monkeypatch):
    """The one test that compiles (about 8 s of CPU, one shape): a tiny bf16 model's gate, compiled and eager."""
    monkeypatch.setattr(PROCESS_KERNELS, "compiled", None)
    monkeypatch.setattr(PROCESS_KERNELS, "fallback", None)
    compiled, eager = gate("compiled"), gate("eager")
    assert [lay["selfcheck"]["kernels"] for lay in compiled["layers"]] == ["compiled"] * len(compiled["layers"])
    assert PROCESS_KERNELS.compiled is not None and PROCESS_KERNELS.fallback is None
    close(compiled["per_window"], eager["per_window"])
    close([{**lay, "selfcheck": None} for lay in compiled["layers"]],
          [{**lay, "selfcheck": None} for lay in eager["layers"]])
    # past the compiler's recompile limit the compiled function would run uncompiled: it raises, and the chunk and
    # the process go eager with the reason, instead of a record that says compiled
    args = chunk(8, 2, 16, 6, torch.float32)  # fp32 fields: the bf16 gate's compile does not hold
    with torch._dynamo.config.patch(recompile_limit=1):
        part, path = PROCESS_KERNELS("compiled", *args)
    assert path == "eager" and PROCESS_KERNELS.fallback.startswith("FailOnRecompileLimitHit"), PROCESS_KERNELS.fallback
    assert torch.equal(part.c2, chunk_receipts(*args).c2)
