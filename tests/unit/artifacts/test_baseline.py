"""Baselines on disk: a bit-identical round trip, mismatches named with nothing overwritten, the first gate without one."""

from __future__ import annotations

import json
import os
import stat

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from atlas_tracking.integrations.lightning import AtlasCallback

from atlas_tracking import (
    AtlasConfig,
    Baseline,
    BaselineError,
    Canary,
    measure,
)
from atlas_tracking.cli import main as cli
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.tiny import (
    POST_TRAINING,
    QUIET,
    SMALL_GATE,
    random_canary,
    tiny_canary,
    tiny_data,
    tiny_module,
)


@pytest.fixture(scope="module")
def saved_baseline(tmp_path_factory):
    model = family_model("qwen3_moe")
    canary = random_canary()
    path = tmp_path_factory.mktemp("base") / "baseline"
    Baseline.from_report(measure(model, canary, config=SMALL_GATE)).save(path)
    return model, canary, path


def test_baseline_roundtrip_is_bit_identical(saved_baseline, tmp_path):
    model, canary, path = saved_baseline
    base = Baseline.load(path)
    again = Baseline.load(base.save(tmp_path / "copy"))
    assert again.manifest == base.manifest
    assert all(torch.equal(again.tensors[k], base.tensors[k]) for k in base.tensors)
    r1 = measure(model, canary, baseline=base, config=SMALL_GATE)
    r2 = measure(model, canary, baseline=again, config=SMALL_GATE)
    assert r1.to_json() == r2.to_json()


def test_a_baseline_is_written_one_tensor_at_a_time(saved_baseline, tmp_path, monkeypatch):
    """The tensor file streams to disk tensor by tensor: no chunk written is larger than the largest tensor (the
    whole file is never one buffer in memory), and what is written is the file a load checks and reads."""
    import atlas_tracking.artifacts.baseline as baseline_module

    model, canary, _ = saved_baseline
    base = Baseline.from_report(measure(model, canary, config=SMALL_GATE))
    largest = max(t.nbytes for t in base.tensors.values())
    total = sum(t.nbytes for t in base.tensors.values())
    sizes: list[int] = []
    write = baseline_module.write_atomic

    def observed(path, data):
        if isinstance(data, (str, bytes)):
            return write(path, data)
        chunks = list(data)  # each chunk is handed over as it comes; the list only keeps them for the count
        sizes.extend(memoryview(c).nbytes for c in chunks[1:])
        return write(path, iter(chunks))

    monkeypatch.setattr(baseline_module, "write_atomic", observed)
    loaded = Baseline.load(base.save(tmp_path / "b"))
    assert len(sizes) == len(base.tensors) and sum(sizes) == total and max(sizes) == largest
    assert all(torch.equal(loaded.tensors[k], base.tensors[k].to(loaded.tensors[k].dtype)) for k in base.tensors)


def test_baseline_mismatches_are_named_and_nothing_is_overwritten(saved_baseline, tmp_path):
    model, canary, path = saved_baseline
    base = Baseline.load(path)
    with pytest.raises(BaselineError, match="canary fingerprint mismatch"):
        measure(model, random_canary(seed=9), baseline=base, config=SMALL_GATE)
    with pytest.raises(BaselineError, match=r"architecture mismatch at routed layer model.layers.0.mlp: family "
                                            "qwen3_moe vs mixtral"):
        measure(family_model("mixtral"), canary, baseline=base, config=SMALL_GATE)
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

    gate = AtlasGate(family_model("qwen3_moe"), random_canary(), SMALL_GATE, out_dir=tmp_path)
    assert gate.run(step=0)["status"] == "BASELINE" and (tmp_path / "baseline" / "manifest.json").exists()


def _fit(root, steps, callbacks, **kw):
    train, val = tiny_data(steps)
    trainer = pl.Trainer(max_steps=steps, val_check_interval=10, check_val_every_n_epoch=None, logger=False,
                         default_root_dir=str(root), callbacks=callbacks, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1,
                         enable_checkpointing=False, **kw)
    module = tiny_module()
    trainer.fit(module, train, val)
    return module


def test_baseline_saved_in_training_serves_the_exported_checkpoint(tmp_path):
    """A LightningModule's baseline (layers model.model.layers.N.mlp) is used by `measure --baseline` on the
    transformers checkpoint exported from it (layers model.layers.N.mlp): the routed layers are the same."""
    torch.manual_seed(0)
    module = _fit(tmp_path, 10, [AtlasCallback(canary=tiny_canary(), config=POST_TRAINING)])
    records = [json.loads(x) for x in (tmp_path / "atlas" / "gates.jsonl").read_text().splitlines()]
    module.model.save_pretrained(tmp_path / "hf")
    tiny_canary().save(tmp_path / "canary.npz")
    (tmp_path / "atlas.yaml").write_text(json.dumps(QUIET))
    rc = cli(["measure", "--model", str(tmp_path / "hf"), "--canary", str(tmp_path / "canary.npz"),
              "--baseline", str(tmp_path / "atlas" / "baseline"), "--config", str(tmp_path / "atlas.yaml"),
              "--out", str(tmp_path / "r.json"), "--quiet"])
    assert rc == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["drift"]["baseline"]["step"] == 0
    # the same weights, canary and baseline as the gate at step 10: the same receipts (same layout, same machine)
    assert data["summary"]["c2"] == pytest.approx(records[-1]["c2"], rel=1e-6)
    assert data["drift"]["c2_delta"] == pytest.approx(records[-1]["c2_delta"], rel=1e-6, abs=1e-9)


def test_baseline_folder_respects_the_umask(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2))
    canary = Canary.from_token_ids(np.arange(4000) % 64, window=32, n_windows=8, seed=0)
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "anchors": 32, "n_bootstrap": 50}})
    old = os.umask(0o022)
    try:
        path = Baseline.from_report(measure(model, canary, config=cfg)).save(tmp_path / "baseline")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [path, *path.iterdir()]}
    assert modes == {"baseline": 0o755, "anchors.safetensors": 0o644, "manifest.json": 0o644}
