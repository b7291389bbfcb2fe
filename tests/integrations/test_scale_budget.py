"""The bytes of a gate at a frontier layout stay inside the cost model of ``benchmarks/scale.py``.

A DeepSeek-V3-shaped model (transformers' own code: 4 routed layers after 3 dense ones, 64 routed experts, k 8,
a shared expert, group routing 8 / 4, width 64, a canary of 4 x 32 tokens) runs three pretraining gates, the
handoff, two post-training gates and an evaluation through ``AtlasGate``. Each gate's bytes by kind must stay within 25% of the formula
fitted in ``benchmarks/scale.json`` (``make bench`` refits it), post-training gates write no baseline, and
retention keeps the handoff's baseline and the last pretraining one.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SLACK = 1.25
"""A gate's bytes of a kind may exceed the fitted formula by this factor (the fit's residuals are a few %)."""


def _within(measured: float, predicted: float, what: str) -> None:
    assert 0 < measured <= SLACK * predicted, f"{what}: {measured:.0f} bytes against {predicted:.0f} fitted"


def test_each_gate_writes_what_the_cost_model_says_and_retention_keeps_two_baselines(script, tmp_path):
    scale = script("benchmarks/scale.py")
    point = scale.Point("DeepSeek-V3", layers=4, experts=64, width=64, windows=4)
    result = scale.run_point(point, out_dir=tmp_path, pretraining=3, post_training=2)
    fits = json.loads((ROOT / "benchmarks" / "scale.json").read_text())["fits"]
    bound = {name: scale.predict(model, result["shape"]) for name, model in fits.items()}
    gates = result["gates"]
    assert [g["phase"] for g in gates] == ["pretraining"] * 3 + ["handoff"] + ["post_training"] * 2 + ["evaluation"]
    for g in gates:
        b = g["bytes"]
        if g["phase"] in ("pretraining", "handoff"):                     # each of these gates makes a baseline
            _within(b["baseline_tensors"], bound["baseline_tensors"], f"baseline tensors at step {g['step']}")
            _within(b["baseline_manifest"], bound["baseline_manifest"], f"baseline manifest at step {g['step']}")
        else:                                                             # post-training gates read the handoff's
            assert b["baseline_tensors"] == b["baseline_manifest"] == 0, f"a baseline written at step {g['step']}"
        if g["phase"] == "evaluation":
            _within(b["evaluations"], bound["evaluation_line"], "evaluation line")
            assert b["receipts"] == b["record_line"] == 0
            continue
        phase = "pretraining" if g["phase"] == "pretraining" else "post_training"
        _within(b["receipts"], bound[f"receipts_{phase}"], f"receipts artifact at step {g['step']}")
        _within(b["record_line"], bound[f"record_line_{phase}"], f"record line at step {g['step']}")
        assert g["tracker_keys"] <= SLACK * bound["tracker_keys"]
    steps = [int(name.split("_")[1].split(".")[0]) for name in result["baseline_folders"]]
    assert steps == [20, 30]                                              # the previous and the current (handoff)


def test_the_formula_is_the_fitted_one(script):
    """A predicted figure is the sum of the fitted terms at the shape (what RESULTS.md extrapolates with)."""
    scale = script("benchmarks/scale.py")
    model = {"terms": ["1", "L*A*d"], "coef": [100.0, 4.0]}
    assert scale.predict(model, {"L": 2, "A": 8, "d": 16}) == 100 + 4 * 2 * 8 * 16
    assert scale.formula(model) == "100 + 4·L·A·d"
