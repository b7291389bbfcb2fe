"""A gate reads its results back to the host once (docs/receipts.md#host-synchronisations).

Counted with ``testing/host_reads.py`` on the CPU, at the points that are host synchronisations on an accelerator: a
gate without a baseline and a gate against one make one read beyond the model's own forward, whatever the number of
routed layers; a gate that collects a baseline one more per micro-batch (its anchors go to the host as it runs).
"""

from __future__ import annotations

import pytest
import torch

from atlas_tracking import AtlasConfig, Baseline, Canary, measure
from atlas_tracking.adapters.base import find_routed_layers
from atlas_tracking.engine.measure import micro_batches
from atlas_tracking.engine.transfer import read_back, send
from atlas_tracking.testing.bench import plain_forward
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.host_reads import host_reads

OWN_READS = {
    "longcat_flash": "its experts' loop reads each expert's token count on the host",
    "dbrx": "its experts' loop reads each expert's token count on the host",
    "jetmoe": "its experts take the per-expert row counts as a Python list",
    "llama4_text": "its experts take rows padded to the largest expert's count, read on the host",
}
"""Families whose experts' own code reads the host at every call: a gate's extra calls of the experts read it too."""

CFG = AtlasConfig.from_dict({"receipts": {"progress": False, "batch_windows": 2, "n_bootstrap": 50}})


def _canary() -> Canary:
    return Canary.from_token_ids(torch.arange(600).mul(7).remainder(64).numpy(), window=16, n_windows=6, seed=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "granitemoe"])
def test_a_gate_reads_the_host_once_beyond_the_forward(family):
    model, canary = family_model(family).eval(), _canary()
    assert len(find_routed_layers(model)) >= 2
    baseline = Baseline.from_report(measure(model, canary, config=CFG))
    with host_reads() as forward:
        plain_forward(model, canary, CFG.receipts.batch_windows)
    with host_reads() as gate:
        measure(model, canary, config=CFG, keep_anchors=False)
    with host_reads() as drift:
        measure(model, canary, baseline=baseline, config=CFG, keep_anchors=False)
    with host_reads() as collect:
        measure(model, canary, config=CFG)
    batches = len(micro_batches(canary, 0, 1, CFG.receipts.batch_windows))
    assert gate.total == forward.total + 1, (gate.where, forward.where)
    assert drift.total == forward.total + 1, (drift.where, forward.where)
    assert collect.total <= forward.total + batches + 1, (collect.where, forward.where)


def test_the_count_sees_every_kind_of_read():
    t = torch.tensor([0.0, 1.0, 2.0])
    with host_reads() as reads:
        t.sum().item()
        bool(t.max() > 0)
        t.nonzero()
        t[t > 0]
        t.tolist()
        t.cpu().tolist()  # one copy, read out once
        torch.unique(t)
    assert reads.total == 7, reads.where
    with host_reads() as none:
        (t * 2).sum(0)
        t.index_select(0, torch.tensor([1]))
        t.numpy()  # a host tensor's memory: on an accelerator the copy before it counts
    assert none.total == 0, none.where


def test_read_back_returns_every_dtype_and_shape_in_one_read():
    tree = {
        "f": torch.randn(3, 5), "h": torch.randn(4, dtype=torch.bfloat16), "i": torch.arange(7),
        "b": torch.tensor([[True, False, True]]), "u": torch.arange(5, dtype=torch.uint8), "s": torch.tensor(2.5),
        "e": torch.zeros(0, 3), "nested": [(1, torch.arange(3, dtype=torch.int32)), None, "text"],
    }
    with host_reads() as reads:
        host = read_back(tree)
    assert reads.total == 1
    for key in ("f", "h", "i", "b", "u", "s", "e"):
        assert host[key].dtype == tree[key].dtype and host[key].shape == tree[key].shape
        assert torch.equal(host[key], tree[key]), key
    assert host["nested"][0][0] == 1 and torch.equal(host["nested"][0][1], tree["nested"][0][1])
    assert host["nested"][1:] == [None, "text"]
    host["f"][0, 0] = 1e9  # the host copy is the caller's own
    assert tree["f"][0, 0] != 1e9
    for key in ("f", "h", "i"):  # and holds its own memory: pickled to another rank, it carries no other tensor's
        assert host[key].untyped_storage().nbytes() == tree[key].numel() * tree[key].element_size()


def test_send_packs_every_dtype_into_one_buffer_and_back():
    """``send``'s packing on the host (the copy to an accelerator is the one step a CPU cannot run)."""
    from atlas_tracking.engine.transfer import pack, places, unpack

    rows = [torch.randn(3, 5), torch.arange(7), torch.tensor([True, False]), torch.randn(2, dtype=torch.float16),
            torch.zeros(0, 4)]
    starts, size = places(rows)
    assert all(start % 16 == 0 for start in starts) and size >= sum(t.numel() * t.element_size() for t in rows)
    buffer = torch.empty(size, dtype=torch.uint8)
    pack(rows, buffer)
    for t, back in zip(rows, unpack(buffer, rows, copy=False)):
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
    rows_of = {"z0": rows[0], "R0": rows[1]}
    assert send(rows_of, "cpu") is rows_of


def test_read_back_splits_what_exceeds_one_transfer():
    """A gate's results beyond ``limit`` bytes come in consecutive transfers (the buffer is a second copy of them)."""
    tree = [torch.arange(10, dtype=torch.float64), torch.ones(3, 4), torch.arange(100)]
    with host_reads() as reads:
        host = read_back(tree, limit=96)
    assert reads.total == 3
    assert all(torch.equal(h, t) for h, t in zip(host, tree))
    with host_reads() as reads:
        read_back(tree)
    assert reads.total == 1
