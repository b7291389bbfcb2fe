"""Bad input gets one clear error naming the problem, and nothing partial is written."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from families import family_model

from atlas_tracking import (
    AtlasConfig,
    Baseline,
    BaselineError,
    Canary,
    CanaryError,
    RouterLogitsError,
    measure,
)
from atlas_tracking.cli import main

QUIET = AtlasConfig.from_dict({"receipts": {"progress": False, "n_bootstrap": 100, "anchors": 32}})


def _canary(n=4, window=16, vocab=64, seed=0):
    return Canary.from_token_ids(np.random.default_rng(seed).integers(0, vocab, 5000), window=window, n_windows=n)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    family_model("qwen3_moe").save_pretrained(root / "model")
    _canary().save(root / "canary.npz")
    return root


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
        measure(model, _canary(window=200), config=QUIET)
    with pytest.raises(CanaryError, match=r"token id \d+ is out of the model's vocabulary \(config.vocab_size=64\)"):
        measure(model, _canary(vocab=500), config=QUIET)


def test_nan_router_logits_name_the_layer():
    model = family_model("qwen3_moe")
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight[2, :] = float("nan")
    with pytest.raises(RouterLogitsError, match=r"routed layer\(s\): model\.layers\.1\.mlp \(\d+ tokens\)$"):
        measure(model, _canary(), config=QUIET)


def test_cli_errors_are_one_line_and_write_nothing(ckpt, tmp_path, capsys):
    out = tmp_path / "r.json"
    np.save(tmp_path / "floats.npy", np.zeros((2, 8), dtype=np.float32))
    cases = [
        (["measure", "--model", str(ckpt / "model"), "--canary", str(tmp_path / "floats.npy"), "--out", str(out)],
         "canary token ids must be integers"),
        (["measure", "--model", str(tmp_path), "--canary", str(ckpt / "canary.npz"), "--out", str(out)],
         "is not a transformers checkpoint directory"),
        (["measure", "--model", str(ckpt / "model"), "--canary", str(tmp_path / "missing.npz"), "--out", str(out)],
         "canary file not found"),
        (["verify", str(tmp_path / "missing.json")], "cannot read receipts artifact"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1
        assert not out.exists()


def test_unknown_family_is_an_error():
    from atlas_tracking.adapters import NoRoutedLayersError

    with pytest.raises(NoRoutedLayersError, match="register an adapter"):
        measure(torch.nn.Sequential(torch.nn.Linear(4, 4)), _canary(), config=QUIET)


def test_bad_config_key():
    with pytest.raises(ValueError, match=r"unknown key 'receipts\.bootstraps'"):
        AtlasConfig.from_dict({"receipts": {"bootstraps": 5}})


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


# --- baselines (issue: baselines and drift) ---------------------------------------------------------


@pytest.fixture(scope="module")
def saved_baseline(tmp_path_factory):
    model = family_model("qwen3_moe")
    canary = _canary()
    path = tmp_path_factory.mktemp("base") / "baseline"
    Baseline.from_report(measure(model, canary, config=QUIET)).save(path)
    return model, canary, path


def test_baseline_roundtrip_is_bit_identical(saved_baseline, tmp_path):
    model, canary, path = saved_baseline
    base = Baseline.load(path)
    again = Baseline.load(base.save(tmp_path / "copy"))
    assert again.manifest == base.manifest
    assert all(torch.equal(again.tensors[k], base.tensors[k]) for k in base.tensors)
    r1 = measure(model, canary, baseline=base, config=QUIET)
    r2 = measure(model, canary, baseline=again, config=QUIET)
    assert r1.to_json() == r2.to_json()


def test_baseline_mismatches_are_named_and_nothing_is_overwritten(saved_baseline, tmp_path):
    model, canary, path = saved_baseline
    base = Baseline.load(path)
    with pytest.raises(BaselineError, match="canary fingerprint mismatch"):
        measure(model, _canary(seed=9), baseline=base, config=QUIET)
    with pytest.raises(BaselineError, match=r"architecture mismatch at routed layer model.layers.0.mlp: family "
                                            "qwen3_moe vs mixtral"):
        measure(family_model("mixtral"), canary, baseline=base, config=QUIET)
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in path.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    data = (broken / "anchors.safetensors").read_bytes()
    (broken / "anchors.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(BaselineError, match="do not match the manifest checksum"):
        Baseline.load(broken)
    (broken / "manifest.json").write_text((path / "manifest.json").read_text()[:100])
    with pytest.raises(BaselineError, match="corrupted or truncated"):
        Baseline.load(broken)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BaselineError, match="schema_version 99"):
        Baseline.load(broken)
    before = {f.name: f.read_bytes() for f in path.iterdir()}
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before


def test_missing_baseline_is_not_an_error_for_the_first_gate(tmp_path):
    from atlas_tracking.gate import AtlasGate

    gate = AtlasGate(family_model("qwen3_moe"), _canary(), QUIET, out_dir=tmp_path)
    assert gate.run(step=0)["status"] == "BASELINE" and (tmp_path / "baseline" / "manifest.json").exists()
