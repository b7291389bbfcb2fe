"""Compact baseline anchors: the form a byte budget chooses, exact zeros in every form, the projection's bound."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from atlas_tracking import AtlasConfig, Baseline, Canary, measure
from atlas_tracking.artifacts.gate_report import verify
from atlas_tracking.engine import measure as measure_module
from atlas_tracking.engine.anchor_storage import (
    AnchorStorage,
    bounds,
    choose_storage,
    content_interval,
    estimate_bytes,
)
from atlas_tracking.gate import AtlasGate
from atlas_tracking.schema.config import ConfigError
from atlas_tracking.testing.families import family_model

DRIFTS = ("coord_drift", "boundary_drift", "transition_drift", "content_drift")
ROUTING = ("boundary_drift", "transition_drift", "content_drift")
ANCHORS = 64
FORMS = {
    "exact": {"baseline_budget_bytes": None},
    "half": {"baseline_fields_dtype": "bfloat16", "anchor_sketch_dim": 0},
    "half-fp16": {"baseline_fields_dtype": "float16", "anchor_sketch_dim": 0},
    "sketch": {"anchor_sketch_dim": 16},
}


def _cfg(**receipts: object) -> AtlasConfig:
    return AtlasConfig.from_dict({"receipts": {"progress": False, "n_bootstrap": 20, "anchors": ANCHORS, **receipts}})


@pytest.fixture(scope="module")
def canary() -> Canary:
    return Canary.from_token_ids(np.random.default_rng(0).integers(0, 64, 6000), window=24, n_windows=8, seed=0)


@pytest.fixture(scope="module")
def model():
    return family_model("qwen3_moe", seed=2)


def _changed(model, part: str, scale: float):
    """A copy with the parameters whose name holds ``part`` moved by ``scale`` times their mean magnitude."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if part in name:
                p.add_(scale * p.abs().mean() * torch.randn_like(p))
    return m


# --- the choice ---------------------------------------------------------------------------------


def test_deepseek_v3_layout_fits_one_gigabyte_and_tiny_models_stay_exact():
    deepseek = [(7168, 8, 256)] * 58
    assert estimate_bytes(deepseek, 1024, AnchorStorage("exact")) > 16e9  # what an exact baseline would take
    chosen = choose_storage(deepseek, 1024, budget=10**9, seed=0)
    assert (chosen.form, chosen.sketch_dim) == ("sketch", 64)
    assert estimate_bytes(deepseek, 1024, chosen) <= 10**9
    assert estimate_bytes(deepseek, 1024, AnchorStorage("sketch", "bfloat16", 128)) > 10**9  # the largest that fits
    assert choose_storage([(64, 8, 128)] * 24, 1024, budget=10**9, seed=0).form == "exact"
    assert choose_storage([(64, 8, 128)] * 24, 1024, budget=50_000_000, seed=0).form == "half"
    assert choose_storage(deepseek, 1024, budget=None, seed=0).form == "exact"


def test_no_form_fits_is_a_config_error_naming_budget_estimate_and_remedy():
    with pytest.raises(ConfigError, match=r"'receipts.baseline_budget_bytes' is 1000 .* needs about \d+ bytes .*"
                                          r"lower 'receipts.anchors'"):
        choose_storage([(64, 2, 8)], 64, budget=1000, seed=0)


def test_explicit_settings_override_the_budget_choice():
    layout = [(7168, 8, 256)] * 58
    assert choose_storage(layout, 1024, 10**12, 0, "float16").form == "half"
    assert choose_storage(layout, 1024, 10**12, 0, None, 256).sketch_dim == 256
    with pytest.raises(ConfigError, match="most compact anchor storage"):  # explicit float32 does not fit
        choose_storage(layout, 1024, 10**9, 0, "float32")
    with pytest.raises(ConfigError, match="anchor_sketch_dim' 64 must be below"):
        choose_storage([(64, 2, 8)], 64, None, 0, None, 64)


@pytest.mark.parametrize("receipts, field", [
    ({"anchor_sketch_dim": -1}, "receipts.anchor_sketch_dim"),
    ({"anchor_sketch_dim": 16, "baseline_fields_dtype": "float32"}, "receipts.anchor_sketch_dim"),
    ({"baseline_budget_bytes": 0}, "receipts.baseline_budget_bytes"),
    ({"baseline_fields_dtype": "float8"}, "receipts.baseline_fields_dtype"),
])
def test_invalid_settings_name_the_field(receipts, field):
    with pytest.raises(ConfigError, match=field):
        AtlasConfig.from_dict({"receipts": receipts})


def test_a_budget_too_small_fails_before_any_forward(model, canary):
    calls = []
    with pytest.raises(ConfigError, match="baseline_budget_bytes"):
        measure(model, canary, config=_cfg(baseline_budget_bytes=1000), forward=lambda *a: calls.append(a))
    assert calls == []


def test_gate_set_up_refuses_a_budget_no_form_fits(model, canary, tmp_path):
    with pytest.raises(ConfigError, match=r"'receipts\.baseline_budget_bytes' is 1000 "):
        AtlasGate(model, canary, _cfg(baseline_budget_bytes=1000), out_dir=tmp_path / "atlas")


# --- exactness and storage ---------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_every_form_gives_exact_zeros_for_itself_and_for_attention_only(model, canary, form, tmp_path):
    cfg = _cfg(**FORMS[form])
    base = Baseline.load(Baseline.from_report(measure(model, canary, config=cfg)).save(tmp_path / "b"))
    storage = base.manifest["anchors"]["storage"]
    assert storage["form"] == form.split("-")[0]
    same = measure(model, canary, baseline=base, config=cfg)
    assert all(layer[k] == 0.0 for layer in same.drift["layers"] for k in DRIFTS)
    for layer in same.per_window["layers"]:  # the coupling's vectors are stored as the fields are: nothing moved
        sums = layer["comove"]
        assert all(x == 0.0 for key in ("router_sq", "state_sq") for x in sums[key]), sums
    width = storage["sketch_dim"] or 32
    assert base.tensors["0.router_rows0"].shape == (6, width)
    assert str(base.tensors["0.field_mean0"].dtype) == f"torch.{storage['fields_dtype']}"
    assert verify(json.loads(same.to_json())) == []
    attention = measure(_changed(model, "self_attn.o_proj", 1.0), canary, baseline=base, config=cfg)
    assert all(layer["coord_drift"] > 0 for layer in attention.drift["layers"])
    assert all(layer[k] == 0.0 for layer in attention.drift["layers"] for k in ROUTING)
    experts = measure(_changed(model, ".experts.", 0.2), canary, baseline=base, config=cfg)
    assert all(layer["content_drift"] > 0 for layer in experts.drift["layers"])


def test_manifest_records_dtypes_projection_and_bounds(model, canary, tmp_path):
    exact = Baseline.from_report(measure(model, canary, config=_cfg(baseline_budget_bytes=None))).save(tmp_path / "e")
    sketch = Baseline.from_report(measure(model, canary, config=_cfg(anchor_sketch_dim=16))).save(tmp_path / "s")
    storage = Baseline.load(sketch).manifest["anchors"]["storage"]
    assert storage["dtypes"] == {"z0": "float16", "g0": "recomputed", "R0": "int64", "p0": "float16",
                                 "u0": "bfloat16", "b0": "uint8"}
    assert (storage["sketch_dim"], storage["sketch_seed"]) == (16, 0)
    assert storage["bounds"] == bounds(AnchorStorage("sketch", "bfloat16", 16), ANCHORS, 2)
    assert storage["bounds"]["content_kappa"] is None  # m = 16 is too small for a bound on 384 norms at once
    assert Baseline.load(sketch).tensors["0.u0"].shape == (ANCHORS, 2, 16)
    layout = [(32, 2, 6)] * 2  # the tiny qwen3_moe: width 32, top-2 of 6 experts, 2 routed layers
    for path, form in ((exact, AnchorStorage("exact")), (sketch, AnchorStorage("sketch", "bfloat16", 16))):
        tensors = Baseline.load(path).tensors
        assert sum(t.nbytes for key, t in tensors.items() if not key.startswith("kl.")) == estimate_bytes(
            layout, ANCHORS, form)  # the estimate made before collecting is the size written


def test_a_baseline_saved_before_storage_forms_reads_as_before(model, canary, tmp_path):
    cfg = _cfg(baseline_budget_bytes=None)
    base = Baseline.from_report(measure(model, canary, config=cfg))
    del base.manifest["anchors"]["storage"]  # the manifest a baseline had before
    old = Baseline.load(base.save(tmp_path / "old"))
    assert old.storage is None and old.tensors["0.g0"].dtype == torch.float32
    changed = _changed(model, ".experts.", 0.2)
    with_storage = Baseline.from_report(measure(model, canary, config=cfg))
    for m in (model, changed):
        a = measure(m, canary, baseline=old, config=cfg).drift["layers"]
        b = measure(m, canary, baseline=with_storage, config=cfg).drift["layers"]
        assert [[layer[k] for k in DRIFTS] for layer in a] == [[layer[k] for k in DRIFTS] for layer in b]


# --- the projection's bound, against the exact fields ------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_projected_content_drift_is_within_the_stated_bound(family, canary, monkeypatch):
    """The same rounded anchors stored with exact float32 fields and with projected ones (m = 64 of width 128):
    each layer's projected ``content_drift`` lies in the interval the manifest's bounds give around the exact."""
    model = family_model(family, seed=1, hidden_size=128)
    changed = _changed(model, ".experts.", 0.2)
    cfg = _cfg()
    drift = {}
    forms = {"fields": AnchorStorage("half", "float32"), "sketch32": AnchorStorage("sketch", "float32", 64),
             "sketch": AnchorStorage("sketch", "bfloat16", 64)}
    for name, form in forms.items():
        monkeypatch.setattr(measure_module, "configured_storage", lambda *a, form=form: form)
        base = Baseline.from_report(measure(model, canary, config=cfg))
        drift[name] = [layer["content_drift"] for layer in measure(changed, canary, baseline=base,
                                                                     config=cfg).drift["layers"]]
    assert all(0 < c < 0.5 for c in drift["fields"])  # a bound clipped at 1 would check nothing
    for name in ("sketch32", "sketch"):
        stated = bounds(forms[name], ANCHORS, 2)
        for c, got in zip(drift["fields"], drift[name]):
            lo, hi = content_interval(c, stated["content_kappa"], stated["fields_roundoff"])
            assert lo <= got <= hi, (family, name, c, got, lo, hi)
    assert drift["sketch32"] != drift["fields"]  # the projection is applied
