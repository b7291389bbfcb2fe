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
