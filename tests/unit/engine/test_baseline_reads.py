"""A gate reads its baselines layer by layer from the memory-mapped file: never every layer's tensors at once,
with the same receipts as a baseline held in memory."""

from __future__ import annotations

import copy
import weakref

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

from atlas_tracking import AtlasConfig, Baseline, BaselineError, Canary, measure
from atlas_tracking.artifacts.tensor_file import TensorFile
from atlas_tracking.testing.families import family_model

LAYERS = 8
DRIFTS = ("coord_drift", "boundary_drift", "transition_drift", "content_drift")


def _cfg(**receipts: object) -> AtlasConfig:
    return AtlasConfig.from_dict({"receipts": {"progress": False, "n_bootstrap": 20, "anchors": 192,
                                               "batch_windows": 2, **receipts}})


@pytest.fixture(scope="module")
def canary() -> Canary:
    return Canary.from_token_ids(np.random.default_rng(0).integers(0, 64, 4000), window=32, n_windows=8, seed=0)


@pytest.fixture(scope="module")
def model():
    return family_model("qwen3_moe", seed=1, num_hidden_layers=LAYERS, hidden_size=64)


@pytest.fixture(scope="module")
def changed(model):
    """A copy whose experts and routers moved: drift away from 0."""
    m = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ".mlp." in name:
                p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    return m


class _Counter:
    """Bytes of the tensors read from a baseline file that are alive now, at most at once, and in all."""

    def __init__(self) -> None:
        self.now = self.peak = self.total = 0

    def read(self, t: torch.Tensor) -> torch.Tensor:
        self.now += t.nbytes
        self.total += t.nbytes
        self.peak = max(self.peak, self.now)
        weakref.finalize(t, self._release, t.nbytes)
        return t

    def _release(self, nbytes: int) -> None:
        self.now -= nbytes


class _Observed:
    """Stands in for what safetensors returns (a file handle, a tensor slice): each tensor it hands out is counted."""

    def __init__(self, obj, counter: _Counter):
        self._obj, self._counter = obj, counter

    def _wrap(self, value):
        if isinstance(value, torch.Tensor):
            return self._counter.read(value)
        if hasattr(value, "get_shape") or hasattr(value, "get_slice"):
            return _Observed(value, self._counter)
        return value

    def __getattr__(self, name):
        attr = getattr(self._obj, name)
        return (lambda *a, **k: self._wrap(attr(*a, **k))) if callable(attr) else attr

    def __getitem__(self, key):
        return self._wrap(self._obj[key])

    def __enter__(self):
        return self._wrap(self._obj.__enter__())

    def __exit__(self, *exc):
        return self._obj.__exit__(*exc)


def _observe_reads(monkeypatch) -> _Counter:
    """Count every tensor read from a safetensors file, by a whole-file read or a memory-mapped one."""
    counter = _Counter()
    whole, mapped = safetensors.torch.load_file, safetensors.safe_open
    monkeypatch.setattr(safetensors.torch, "load_file",
                        lambda *a, **k: {key: counter.read(t) for key, t in whole(*a, **k).items()})
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: _Observed(mapped(*a, **k), counter))
    return counter


def _layer_bytes(path) -> list[int]:
    tensors = safetensors.torch.load_file(str(path / "anchors.safetensors"))
    return [sum(t.nbytes for key, t in tensors.items() if key.startswith(f"{i}.")) for i in range(LAYERS)]


def test_a_gate_holds_at_most_one_layer_of_each_baseline_in_host_memory(model, changed, canary, tmp_path,
                                                                        monkeypatch):
    cfg = _cfg()
    path = Baseline.from_report(measure(model, canary, config=cfg)).save(tmp_path / "b")
    per_layer = _layer_bytes(path)
    counter = _observe_reads(monkeypatch)
    baseline, base = Baseline.load(path), Baseline.load(path)  # the reference and a post-training base
    report = measure(changed, canary, baseline=baseline, base=base, config=cfg)
    assert all(layer[key] > 0 for layer in report.drift["layers"] for key in ("boundary_drift", "content_drift"))
    # every layer of both baselines was read, yet at no point were more than two layers' tensors alive at once
    # (the rows of one layer's micro-batch per baseline): every layer at once would be LAYERS times one
    assert counter.total >= 2 * sum(per_layer)
    assert counter.peak <= 2 * max(per_layer), (counter.peak, per_layer)
    assert counter.now == 0  # nothing read is kept after the gate


@pytest.mark.parametrize("form", [{"baseline_budget_bytes": None}, {"anchor_sketch_dim": 16}], ids=["exact", "sketch"])
def test_receipts_read_from_the_file_equal_those_of_a_baseline_in_memory(model, changed, canary, tmp_path, form):
    cfg = _cfg(**form)
    report = measure(model, canary, config=cfg)
    loaded = Baseline.load(Baseline.from_report(report).save(tmp_path / "b"))
    assert isinstance(loaded.tensors, TensorFile)
    for m in (model, changed):
        from_file = measure(m, canary, baseline=loaded, config=cfg)
        in_memory = measure(m, canary, baseline=Baseline.from_report(report), config=cfg)
        assert from_file.to_json() == in_memory.to_json()
    frozen = measure(model, canary, baseline=loaded, config=cfg)
    assert all(layer[key] == 0.0 for layer in frozen.drift["layers"] for key in DRIFTS[1:])


def test_a_saved_baseline_drops_its_host_copy_and_a_replaced_file_is_an_error(model, changed, canary, tmp_path):
    cfg = _cfg()
    baseline = Baseline.from_report(measure(model, canary, config=cfg))
    baseline.save(tmp_path / "b")
    assert isinstance(baseline.tensors, TensorFile)  # read from the file from now on, no copy in memory
    measure(changed, canary, baseline=baseline, config=cfg)
    Baseline.from_report(measure(changed, canary, config=cfg)).save(tmp_path / "b")  # another baseline there now
    with pytest.raises(BaselineError, match="was replaced or removed after it was checked"):
        measure(changed, canary, baseline=baseline, config=cfg)
