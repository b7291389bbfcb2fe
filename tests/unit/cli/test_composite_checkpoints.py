"""The command line measures composite (vision-language) MoE checkpoints through their text model, and configs
that AutoModelForCausalLM does not map (Mistral 4)."""

from __future__ import annotations

import numpy as np
import pytest

from atlas_tracking.artifacts.gate_report import read_artifact, verify
from atlas_tracking.cli import main
from atlas_tracking.testing.families import family_model


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "mistral4"])
def test_measure_loads_a_composite_checkpoint_through_its_text_model(family, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    family_model(family).save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="Unrecognized configuration class"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    np.save(tmp_path / "canary.npy", (np.arange(4 * 16).reshape(4, 16) * 7 % 64).astype(np.int64))
    cfg = tmp_path / "atlas.yaml"
    cfg.write_text("receipts: {batch_windows: 4, anchors: 16, n_bootstrap: 20}\n")
    code = main(["measure", "--model", str(tmp_path / "ckpt"), "--canary", str(tmp_path / "canary.npy"),
                 "--out", str(tmp_path / "r.json"), "--config", str(cfg), "--quiet"])
    assert code == 0, capsys.readouterr().err
    data = read_artifact(tmp_path / "r.json")
    assert data["model"]["families"] == [family] and verify(data) == []
