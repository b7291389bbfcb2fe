"""Writes that rename into place are durable: the new file is fsynced before the rename, the directory after."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from atlas_tracking.artifacts import io
from atlas_tracking.artifacts.history import write_lines
from atlas_tracking.engine.canary import Canary


@pytest.fixture
def events(monkeypatch):
    """What reaches the disk, in order: ``file`` / ``dir`` fsyncs and ``replace`` renames."""
    seen: list[str] = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd):
        seen.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        fsync(fd)

    def spy_replace(src, dst):
        seen.append("replace")
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    return seen


def test_write_atomic_syncs_the_file_before_the_rename_and_the_directory_after(tmp_path, events):
    io.write_atomic(tmp_path / "a.json", "{}")
    io.write_atomic(tmp_path / "b.bin", b"\x00\x01")
    assert events == ["file", "replace", "dir"] * 2
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01" and sorted(os.listdir(tmp_path)) == ["a.json", "b.bin"]


@pytest.mark.parametrize("write", [
    lambda d: write_lines(d / "gates.jsonl", [{"step": 1}]),
    lambda d: Canary.from_token_ids(np.arange(400) % 50, window=16, n_windows=4, seed=0).save(d / "canary.npz"),
    lambda d: Canary.from_token_ids(np.arange(400) % 50, window=16, n_windows=4, seed=0).save(d / "canary.npy"),
], ids=["history lines", "canary npz", "canary npy"])
def test_every_rename_into_place_goes_through_the_durable_write(tmp_path, events, write):
    write(tmp_path)
    assert events == ["file", "replace", "dir"]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_canary_saved_durably_reads_back(tmp_path):
    canary = Canary.from_token_ids(np.arange(400) % 50, window=16, n_windows=4, seed=3)
    assert Canary.load(canary.save(tmp_path / "c.npz")).fingerprint == canary.fingerprint


def test_replace_durably_syncs_both_directories_of_a_move(tmp_path, events):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_text("x")
    io.replace_durably(tmp_path / "src" / "f", tmp_path / "f")
    assert events == ["replace", "dir", "dir"] and (tmp_path / "f").read_text() == "x"


def test_a_tensor_file_written_in_chunks_reads_back_in_safetensors(tmp_path):
    """Every dtype a tensor file holds, empty and 0-d tensors and a strided view, read back by safetensors itself."""
    import safetensors
    import torch
    from safetensors.torch import load_file

    from atlas_tracking.artifacts.tensor_file import safetensors_chunks

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(5, 3, generator=gen), "f16": torch.randn(4, generator=gen).half(),
        "bf16": torch.randn(2, 3, generator=gen).bfloat16(), "f64": torch.randn(3, generator=gen).double(),
        "i64": torch.arange(7).view(7, 1), "i32": torch.arange(3, dtype=torch.int32), "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]), "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5),
        "strided": torch.arange(12.0).view(3, 4).T,
    }
    path = io.write_atomic(tmp_path / "t.safetensors", safetensors_chunks(tensors, {"kind": "test"}))
    back = load_file(path)
    assert back.keys() == tensors.keys()
    for key, t in tensors.items():
        assert back[key].dtype == t.dtype and back[key].shape == t.shape and torch.equal(back[key], t), key
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"kind": "test"}


def test_a_chunked_write_that_fails_leaves_the_old_file_and_nothing_beside_it(tmp_path):
    io.write_atomic(tmp_path / "t.bin", b"old")

    def chunks():
        yield b"new, "
        raise RuntimeError("a tensor could not be read")

    with pytest.raises(RuntimeError, match="could not be read"):
        io.write_atomic(tmp_path / "t.bin", chunks())
    assert (tmp_path / "t.bin").read_bytes() == b"old" and os.listdir(tmp_path) == ["t.bin"]
