"""Every supported transformers family on a CUDA device (marked ``gpu``: ``make gpu-check`` runs these; skipped
without CUDA).

Per family, the tiny random model of ``atlas_tracking.testing.families``, moved to the GPU:
- in fp32, the adapter's active sets are the ones the model hands its experts there (CUDA kernels included),
  ``sum_e w_e u_e(g) + shared(g)`` is the block's output within 1e-5 relative, ``measure`` + ``verify`` pass and a
  checkpoint compared with itself drifts by exactly 0;
- the per-layer receipts of the CUDA gate equal the CPU fp32 gate's of the same weights within ``TOLERANCE``,
  on a canary without the pad token (layers whose per-window loads differ, a near-tie routed the other way by
  the other device's kernels, are counted rather than compared, and at most ``ROUTES_MOVED`` of the routes may
  move), except for the families of ``OWN_FORWARD_DIFFERS``;
- in bf16 (as transformers loads it) the fp32 selection scores reproduce the model's choice, and ``measure`` +
  ``verify`` pass with self-drift exactly 0 again.
The largest deviation and the count of such layers go to the test's junit properties (``make gpu-check``'s JSON).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from atlas_tracking import Canary, measure
from atlas_tracking.testing.families import (
    CFG,
    FAMILIES,
    capture_layers,
    check_bf16,
    check_exact,
    check_measure,
    family_model,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOLERANCE = 1e-3
"""Largest ``|cuda - cpu| / max(1, |cpu|)`` of a per-layer receipt between a CUDA and a CPU gate, both fp32."""
SCORES = 1e-4
"""Largest difference of a first-layer selection score between the devices (measured on an H200: <= 3.3e-6)."""
OWN_FORWARD_DIFFERS = frozenset({"deepseek_v32", "glm_moe_dsa", "dots3_note_text"})
"""Families whose own forward differs between CPU and CUDA before the first routed layer (their sparse-attention
indexer: first-layer scores 0.12-0.15 apart on an H200 in fp32): their receipts are not compared across devices;
every other check runs."""
ROUTES_MOVED = 0.02
"""Largest fraction of routes the two devices' fp32 kernels may assign differently (near-ties of the scores; one
moved route changes every later layer's input, so such layers are counted rather than compared)."""


def receipt_deviation(cpu: dict, cuda: dict) -> tuple[float, int]:
    """The largest scaled deviation over the per-layer receipts of two reports of the same weights and canary,
    and the number of layers left out because their per-window loads differ.

    Example:
        >>> a = {"layers": [{"receipts": {"c2": 0.5, "margin_mean": None}}],
        ...      "per_window": {"layers": [{"load": [[1, 2]]}]}}
        >>> b = {"layers": [{"receipts": {"c2": 0.5004, "margin_mean": None}}],
        ...      "per_window": {"layers": [{"load": [[1, 2]]}]}}
        >>> dev, flipped = receipt_deviation(a, b)
        >>> round(dev, 6), flipped
        (0.0004, 0)
    """
    worst, flipped = 0.0, 0
    for la, lb, wa, wb in zip(cpu["layers"], cuda["layers"], cpu["per_window"]["layers"],
                              cuda["per_window"]["layers"], strict=True):
        if wa["load"] != wb["load"]:
            flipped += 1
            continue
        for key, va in la["receipts"].items():
            vb = lb["receipts"][key]
            if isinstance(va, (int, float)) and not isinstance(va, bool) and vb is not None and math.isfinite(va):
                worst = max(worst, abs(vb - va) / max(1.0, abs(va)))
    return worst, flipped


def compared_canary() -> Canary:
    """``check_canary``'s windows without the pad token (id 0): its zero embedding gives the first position an
    all-zero router input, an exact tie that each device's top-k breaks its own way."""
    return Canary.from_token_ids(np.arange(400) * 7 % 63 + 1, window=16, n_windows=4, seed=0)


def first_layer_scores(model, ids: torch.Tensor) -> torch.Tensor:
    """The adapter's selection scores of the first routed layer over ``ids``, on the host, in fp32."""
    layers, seen = capture_layers(model, ids)
    d = seen[layers[0].name]
    return layers[0].routing(d["router"], d["g"].reshape(-1, d["g"].shape[-1])).scores.float().cpu()


def routes_moved(cpu: dict, cuda: dict) -> float:
    """The fraction of (token, expert) routes one report has and the other has not, over every layer."""
    moved = total = 0
    for wa, wb in zip(cpu["per_window"]["layers"], cuda["per_window"]["layers"], strict=True):
        moved += sum(abs(a - b) for ra, rb in zip(wa["load"], wb["load"]) for a, b in zip(ra, rb)) / 2
        total += sum(map(sum, wa["load"]))
    return moved / max(total, 1)


@pytest.fixture
def fp32_matmuls():
    """fp32 matrix products in full fp32 on the GPU (no TF32) while the test runs, as on the CPU."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield before
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_on_cuda(family, record_property, fp32_matmuls):
    model = family_model(family)
    ids = torch.randint(1, 64, (4, 16), generator=torch.Generator().manual_seed(5))
    on_cpu, scores_cpu = measure(model, compared_canary(), config=CFG).to_dict(), first_layer_scores(model, ids)
    model.cuda()
    check_exact(family, model)
    check_measure(model)
    on_cuda, scores_cuda = measure(model, compared_canary(), config=CFG).to_dict(), first_layer_scores(model, ids)
    finite = torch.isfinite(scores_cpu) & torch.isfinite(scores_cuda)
    deviation, flipped = receipt_deviation(on_cpu, on_cuda)
    moved = routes_moved(on_cpu, on_cuda)
    record_property("fp32_first_layer_score_max_abs_diff", float((scores_cuda - scores_cpu)[finite].abs().max()))
    record_property("fp32_cuda_vs_cpu_max_deviation", deviation)
    record_property("fp32_layers_routed_differently", flipped)
    record_property("fp32_routes_moved_fraction", moved)
    record_property("float32_matmul_precision_default_high", float(fp32_matmuls != "highest"))
    if family not in OWN_FORWARD_DIFFERS:
        assert float((scores_cuda - scores_cpu)[finite].abs().max()) <= SCORES, family
        assert deviation <= TOLERANCE, (family, deviation)
        assert moved <= ROUTES_MOVED, (family, moved)
    check_bf16(family, model)  # the model is bf16 from here on
    check_measure(model)
