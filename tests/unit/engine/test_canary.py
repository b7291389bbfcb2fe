"""The canary: bad input is one clear error naming the problem; determinism, fingerprint, round trip, shards."""

from __future__ import annotations

import numpy as np
import pytest

from atlas_tracking import (
    Canary,
    CanaryError,
    measure,
)
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.tiny import SMALL_GATE, random_canary


def test_empty_canary_and_short_windows():
    with pytest.raises(CanaryError, match="canary is empty"):
        Canary(windows=np.zeros((0, 8), dtype=np.int64))
    with pytest.raises(CanaryError, match="at least two tokens"):
        Canary(windows=np.zeros((3, 1), dtype=np.int64))
    with pytest.raises(CanaryError, match="holds only 2 windows of 10; 5 requested"):
        Canary.from_token_ids(np.arange(25), window=10, n_windows=5)


def test_window_longer_than_context_and_ids_out_of_vocab():
    model = family_model("qwen3_moe")
    with pytest.raises(CanaryError, match=r"window length 200 exceeds the model's context \(config.max_position_embeddings=128\)"):
        measure(model, random_canary(window=200), config=SMALL_GATE)
    with pytest.raises(CanaryError, match=r"token id \d+ is out of the model's vocabulary \(config.vocab_size=64\)"):
        measure(model, random_canary(vocab=500), config=SMALL_GATE)


def test_canary_determinism_fingerprint_roundtrip_and_shards(tmp_path):
    ids = np.random.default_rng(1).integers(0, 64, 3000)
    a, b = Canary.from_token_ids(ids, 20, 10, seed=4), Canary.from_token_ids(ids, 20, 10, seed=4)
    assert a == b and a != Canary.from_token_ids(ids, 20, 10, seed=5)
    changed = Canary(windows=a.windows.copy())
    changed.windows[3, 7] += 1
    assert changed.fingerprint != a.fingerprint
    for suffix in (".npy", ".npz"):
        assert Canary.load(a.save(tmp_path / f"c{suffix}")).fingerprint == a.fingerprint
    for world in (1, 2, 3, 4):
        seen = [w for r in range(world) for s, e in a.shard(r, world, 3) for w in range(s, e)]
        assert sorted(seen) == list(range(10))
