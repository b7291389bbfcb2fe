"""A gate's near-tie mass (docs/receipts.md#near-tie-mass) is the count the test takes itself.

On tiny random models of three families (a softmax router ranking its logits, DeepSeek-V3's sigmoid + bias inside
a group limit, LongCat-Flash's softmax + bias with zero-computation experts), the test runs the gate's micro-batches
of the canary with hooks of its own on every router, rebuilds the selection scores from the logits the router
returned with each family's own formula (not the adapter's), and counts near ties with a plain-numpy loop: the
gate's per-window counts, layer totals, shares, record fields and tracker keys equal those counts exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atlas_tracking import measure
from atlas_tracking.artifacts.gate_report import verify
from atlas_tracking.artifacts.record import gate_metrics, gate_record
from atlas_tracking.receipts.state1 import NEAR_TIE_DTYPES
from atlas_tracking.testing.families import CFG, capture_layers, family_model
from atlas_tracking.testing.numpy_reference import near_tie_loop
from atlas_tracking.testing.tiny import random_canary

CANARY = random_canary(n=8, window=32)
EPS = [torch.finfo(p).eps for p in NEAR_TIE_DTYPES.values()]


def _group_limited(s: torch.Tensor, router) -> torch.Tensor:
    """DeepSeek-V3's group limit: experts outside the ``topk_group`` groups with the best two-expert sums are -inf."""
    groups = s.view(len(s), router.num_group, -1)
    best = groups.topk(2, dim=-1).values.sum(-1).topk(router.topk_group, dim=-1).indices
    keep = torch.zeros(groups.shape[:2], dtype=torch.bool).scatter(1, best, True)
    return s.masked_fill(~keep.repeat_interleave(groups.shape[-1], dim=1), float("-inf"))


SCORES = {
    "qwen3_moe": lambda logits, router: logits.float(),
    "deepseek_v3": lambda logits, router: _group_limited(logits.float().sigmoid() + router.e_score_correction_bias,
                                                         router),
    "longcat_flash": lambda logits, router: logits.float().softmax(-1) + router.e_score_correction_bias,
}


def _own_near_ties(model, family: str) -> dict[str, list]:
    """Per routed layer, the loop's answer for every canary token in window order, from the test's own router hooks
    on the gate's micro-batches."""
    ids, per = torch.as_tensor(CANARY.windows), CFG.receipts.batch_windows
    out: dict[str, list] = {}
    for start in range(0, len(ids), per):
        layers, seen = capture_layers(model, ids[start:start + per])
        for lay in layers:
            logits, _, index = seen[lay.name]["router"]
            scores = SCORES[family](logits, lay.router)
            out.setdefault(lay.name, []).extend(near_tie_loop(scores.numpy(), index.numpy(), EPS))
    return out


@pytest.mark.parametrize("family", list(SCORES))
def test_the_gates_near_tie_mass_is_the_count_of_the_tests_own_hooks(family):
    model = family_model(family)
    report = measure(model, CANARY, config=CFG)
    data = report.to_dict()
    assert verify(data) == []
    own = _own_near_ties(model, family)
    assert list(own) == [lay["name"] for lay in report.layers]
    record = gate_record(report, None, step=0, loss=None)
    for lay, pw, entry in zip(report.layers, data["per_window"]["layers"], record["layers"]):
        ref = own[lay["name"]]
        assert len(ref) == CANARY.n_windows * CANARY.window
        counted = np.array([r is not None for r in ref]).reshape(CANARY.n_windows, -1)
        hits = np.array([r or [False, False] for r in ref]).reshape(CANARY.n_windows, -1, len(EPS))
        tokens = {"counted": int(counted.sum())}
        for j, name in enumerate(NEAR_TIE_DTYPES):
            assert pw["near_tie"][name]["sum"] == hits[..., j].sum(1).tolist(), (lay["name"], name)
            assert pw["near_tie"][name]["count"] == counted.sum(1).tolist(), (lay["name"], name)
            tokens[name] = int(hits[..., j].sum())
            assert lay["receipts"]["near_tie"][name] == tokens[name] / tokens["counted"], (lay["name"], name)
        assert lay["receipts"]["near_tie_tokens"] == tokens, lay["name"]
        assert tokens["bf16"] > 0, lay["name"]  # the canary holds near ties at bf16 in every layer
        assert (entry["near_tie"], entry["near_tie_tokens"]) == (lay["receipts"]["near_tie"], tokens)
    metrics = gate_metrics(record)
    for name in NEAR_TIE_DTYPES:
        shares = [lay["receipts"]["near_tie"][name] for lay in report.layers]
        assert metrics[f"atlas/near_tie_{name}_max"] == max(shares)
        assert metrics[f"atlas/near_tie_{name}"] == pytest.approx(np.mean(shares), rel=1e-15)


def test_verify_recomputes_the_near_tie_mass_from_the_per_window_counts():
    data = measure(family_model("qwen3_moe"), CANARY, config=CFG).to_dict()
    first, second = (lay["name"] for lay in data["layers"])
    data["layers"][0]["receipts"]["near_tie_tokens"]["bf16"] += 1
    data["per_window"]["layers"][1]["near_tie"]["fp16"]["sum"][0] += 1
    problems = verify(data)
    assert any(p.startswith(f"{first}: near_tie_tokens is") for p in problems), problems
    assert any(p.startswith(f"{second}: near_tie is") for p in problems), problems
    assert any(p.startswith("summary: near_tie_fp16 is") for p in problems), problems
