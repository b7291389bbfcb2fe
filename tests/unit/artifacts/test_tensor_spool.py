"""The spool a gate collects a baseline's anchors into: row blocks in any order read back as the whole tensors
(checked against numpy concatenations of the blocks), gaps and mixed rows named, several ranks' spools joined and
sent between processes, nothing left on disk, and a baseline written from it one tensor at a time."""

from __future__ import annotations

import itertools
import os
import pickle
import tempfile

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from atlas_tracking import AtlasConfig, Baseline, measure
from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.artifacts.io import write_atomic
from atlas_tracking.artifacts.tensor_file import safetensors_chunks
from atlas_tracking.artifacts.tensor_spool import TensorSpool
from atlas_tracking.engine.measure import default_forward
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.tiny import SMALL_GATE, random_canary

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool]


def _blocks(dtype: torch.dtype, n: int, row: tuple[int, ...], seed: int) -> list[tuple[int, torch.Tensor]]:
    """A tensor of ``n`` rows cut into uneven blocks ``(start, rows)``, returned shuffled."""
    g = torch.Generator().manual_seed(seed)
    whole = (torch.randn((n, *row), generator=g) * 50).to(dtype)
    cuts = [0, *sorted(torch.randperm(n - 1, generator=g)[:3].add(1).tolist()), n]
    blocks = [(a, whole[a:b]) for a, b in itertools.pairwise(cuts)]
    return [blocks[i] for i in torch.randperm(len(blocks), generator=g).tolist()]


def _numpy_whole(blocks: list[tuple[int, torch.Tensor]]) -> np.ndarray:
    """The reference: the blocks' bytes concatenated in row order by numpy."""
    ordered = sorted(blocks, key=lambda b: b[0])
    return np.concatenate([t.contiguous().view(torch.uint8).numpy().reshape(len(t), -1) for _, t in ordered])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_blocks_in_any_order_read_back_whole_and_by_rows(dtype):
    spool = TensorSpool()
    blocks = _blocks(dtype, 23, (3, 2), seed=1)
    for start, rows in blocks:
        spool.add("t", start, rows)
    whole = spool["t"]
    assert spool.meta("t") == (dtype, (23, 3, 2)) and whole.dtype == dtype and whole.shape == (23, 3, 2)
    assert np.array_equal(whole.contiguous().view(torch.uint8).numpy().reshape(23, -1), _numpy_whole(blocks))
    for lo, hi in [(0, 23), (4, 17), (22, 40), (30, 35), (5, 5)]:
        assert torch.equal(spool.rows(["t"], lo, hi)["t"], whole[lo:hi]), (lo, hi)


def test_missing_or_repeated_rows_and_mixed_rows_are_named():
    spool = TensorSpool()
    spool.add("t", 0, torch.zeros(3, 2))
    spool.add("t", 5, torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"'t' has rows 3:5 missing or written twice"):
        spool["t"]
    spool.add("u", 0, torch.zeros(2, 2))
    spool.add("u", 1, torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"'u' has rows 2:1 missing or written twice"):
        spool.meta("u")
    with pytest.raises(ValueError, match=r"'t' holds rows of \(torch.float32, \(2,\)\), not \(torch.float64, \(2,\)\)"):
        spool.add("t", 3, torch.zeros(2, 2, dtype=torch.float64))
    with pytest.raises(KeyError):
        spool["absent"]


def test_ranks_spools_join_and_travel_with_their_bytes():
    """Each rank holds every other block (as a distributed gate's micro-batches); sent to another process (pickled)
    and joined, they read back as the whole tensor, and what is added to the joined spool leaves the sources alone."""
    blocks = sorted(_blocks(torch.float32, 40, (4,), seed=2), key=lambda b: b[0])
    ranks = [TensorSpool(), TensorSpool()]
    for j, (start, rows) in enumerate(blocks):
        ranks[j % 2].add("z", start, rows)
    with pytest.raises(ValueError, match="missing"):
        ranks[0]["z"]  # one rank alone has gaps
    sent = [pickle.loads(pickle.dumps(r)) for r in ranks]
    for joined in (TensorSpool.joined(ranks), TensorSpool.joined(sent)):
        assert np.array_equal(joined["z"].view(torch.uint8).numpy().reshape(40, -1), _numpy_whole(blocks))
    before = [f.fh.seek(0, os.SEEK_END) for r in ranks for f in r._files]
    joined = TensorSpool.joined(ranks)
    joined.add("gamma", 0, torch.ones(4))
    assert [f.fh.seek(0, os.SEEK_END) for r in ranks for f in r._files] == before and "gamma" not in ranks[0]
    assert torch.equal(joined["gamma"], torch.ones(4))


def test_nothing_is_left_on_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    spool = TensorSpool()
    spool.add("t", 0, torch.ones(1000, 16))
    assert os.listdir(tmp_path) == [] and spool["t"].sum() == 16000  # the file has no name from the start
    del spool


def test_safetensors_from_a_spool_reads_no_tensor_for_its_header(tmp_path, monkeypatch):
    spool = TensorSpool()
    for name, dtype in [("a", torch.float32), ("b", torch.bool), ("c", torch.bfloat16)]:
        for start, rows in _blocks(dtype, 9, (2,), seed=3):
            spool.add(name, start, rows)
    expected = {name: spool[name] for name in spool}
    reads: list[str] = []
    read = TensorSpool.rows
    monkeypatch.setattr(TensorSpool, "rows", lambda self, names, lo, hi: reads.extend(names) or read(self, names, lo, hi))
    path = write_atomic(tmp_path / "t.safetensors", safetensors_chunks(spool, {"kind": "test"}))
    assert reads == ["a", "b", "c"]  # each tensor read once, for its data
    assert all(torch.equal(t, expected[k]) for k, t in load_file(path).items())


def test_a_collecting_gate_spools_each_layers_anchors_as_it_collects_them(monkeypatch, tmp_path):
    """On the CPU a routed layer's collected anchors go to the spool within its own call, before the next layer
    runs: host memory holds one layer's part of one micro-batch at most. The baseline written from the spool is
    the one read back."""
    model, canary = family_model("qwen3_moe"), random_canary()
    events: list[tuple[str, int]] = []
    add = TensorSpool.add
    monkeypatch.setattr(TensorSpool, "add", lambda self, name, start, rows: events.append((name, start))
                        or add(self, name, start, rows))
    layers = find_routed_layers(model)
    for i, layer in enumerate(layers):
        layer.block.register_forward_pre_hook(lambda module, args, i=i: events.append(("layer", i)))
    cfg = AtlasConfig.from_dict({"receipts": {**SMALL_GATE.to_dict()["receipts"], "batch_windows": 1}})
    report = measure(model, canary, config=cfg, layers=layers,
                     forward=lambda m, ids: events.append(("forward", -1)) or default_forward(m, ids))
    window_of = np.asarray(report.anchors["positions"]) // canary.window  # the canary window of each anchor
    forwards = [i for i, (name, _) in enumerate(events) if name == "forward"]
    assert len(forwards) == canary.n_windows > 1
    held = 0
    for j, (lo, hi) in enumerate(zip(forwards, [*forwards[1:], len(events)])):
        first = int(np.searchsorted(window_of, j))  # the first anchor of micro-batch j (one window each)
        holds = first < len(window_of) and window_of[first] == j
        current = None
        for name, start in events[lo + 1 : hi]:
            if name == "layer":
                current = start
            elif name.split(".")[-1] == "z0":
                assert name == f"{current}.z0" and start == first and holds, (j, name, current)
        held += holds
    assert held >= 2 and all(f"{i}.z0" in report.anchors["tensors"] for i in range(len(layers)))
    base = Baseline.from_report(report)
    loaded = Baseline.load(base.save(tmp_path / "b"))
    assert sorted(loaded.tensors) == sorted(base.tensors)
    assert all(torch.equal(loaded.tensors[k], base.tensors[k]) for k in base.tensors)
