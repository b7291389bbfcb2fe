"""Rough edges a new user meets (issue 17, item 5): each test fails on the code before the fix."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from atlas_tracking.integrations.lightning import AtlasCallback
from lightning_helpers import POST_TRAINING, QUIET, tiny_canary, tiny_data, tiny_module
from test_callback_options import CLI_MODULE

from atlas_tracking import AtlasConfig, Baseline, Canary, find_routed_layers, measure
from atlas_tracking.cli import main as cli
from atlas_tracking.figures import fig_layer_c2, pyplot
from atlas_tracking.gate_report import protected_ordinals
from atlas_tracking.record import gate_metrics
from atlas_tracking.tables import format_table, summary_line


def _fit(root, steps, callbacks, **kw):
    train, val = tiny_data(steps)
    trainer = pl.Trainer(max_steps=steps, val_check_interval=10, check_val_every_n_epoch=None, logger=False,
                         default_root_dir=str(root), callbacks=callbacks, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1,
                         enable_checkpointing=False, **kw)
    module = tiny_module()
    trainer.fit(module, train, val)
    return module


def test_lightning_cli_wrong_config_key_is_said_first(tmp_path):
    """One wrong key in the callback's atlas config: the error naming it comes before the parser's traceback."""
    tiny_canary().save(tmp_path / "canary.npz")
    config = tmp_path / "cli.yaml"
    config.write_text(f"""
trainer:
  max_steps: 10
  logger: false
  enable_checkpointing: false
  accelerator: cpu
  default_root_dir: {tmp_path}
  callbacks:
    - class_path: atlas_tracking.integrations.lightning.AtlasCallback
      init_args:
        canary: {tmp_path / 'canary.npz'}
        config: {{policy: {{c2_toll: 0.1}}}}
""")
    script = tmp_path / "cli.py"
    script.write_text(CLI_MODULE.format(tests=str(Path(__file__).parent), config=str(config)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode != 0
    first = next(i for i, line in enumerate(lines) if "unknown key 'policy.c2_toll'" in line)
    assert first < 8, "\n".join(lines[:first + 1])
    assert "allowed keys: " in lines[first] and "c2_tol" in lines[first].split("allowed keys: ")[1]


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


def test_cv_units_are_unambiguous():
    """Summary mean/max CV are percentages (the policy's unit), per-layer load_cv a fraction: names say which."""
    rec = {"step": 1, "c2": 0.1, "dead_experts": 0.0, "min_entropy": 2.0, "mean_cv": 45.0, "max_cv": 60.0,
           "layers": [{"ordinal": 0, "load_cv": 0.45}, {"ordinal": 1, "load_cv": 0.30}]}
    metrics = gate_metrics(rec)
    assert "atlas/mean_cv" not in metrics and "atlas/max_cv" not in metrics
    assert metrics["atlas/mean_cv_pct"] == 45.0 and metrics["atlas/max_cv_pct"] == 60.0
    assert metrics["atlas/layer_00/load_cv"] == 0.45
    assert "cv%=45.0" in summary_line(rec)


def test_report_groups_layers_by_the_records_protected_flag():
    """The report's per-layer figure calls 'mid' (protected) exactly the layers the records mark protected."""
    n = 8
    protected = set(protected_ordinals(n, "mid"))
    layers = [{"name": f"model.layers.{i}.mlp", "ordinal": i, "protected": i in protected, "c2": 0.1} for i in range(n)]
    fig = fig_layer_c2(layers, "t")
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    pyplot().close(fig)
    shown = {label.split(": ")[1] for label in labels if label.split(": ")[0] in ("mid", "protected")}
    assert shown == {f"model.layers.{i}.mlp" for i in protected}


def test_progress_in_a_log_file_is_plain_lines(tmp_path, monkeypatch):
    """stderr that is not a terminal (a log file) gets whole lines, never carriage returns."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2))
    canary = Canary.from_token_ids(np.arange(4000) % 64, window=32, n_windows=16, seed=0)
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    measure(model, canary, config={"receipts": {"progress": True, "batch_windows": 4, "n_bootstrap": 50}})
    text = log.getvalue()
    assert "\r" not in text
    assert text.endswith("\n") and "atlas: 16/16 canary windows" in text.splitlines()[-1]


def test_no_routed_layer_error_names_the_public_function():
    with pytest.raises(ValueError, match=r"register an adapter with atlas_tracking\.register_family") as info:
        find_routed_layers(torch.nn.Linear(4, 4))
    assert "atlas_tracking.adapters.register_family" not in str(info.value)
    import atlas_tracking

    assert callable(atlas_tracking.register_family)


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


def test_tables_sign_a_column_consistently():
    table = format_table(["c2", "dc2"], [[0.166, 0.0128], [0.0972, -0.0074], [0.150, 0.0]])
    rows = [line.split() for line in table.splitlines()[2:]]
    assert [r[0] for r in rows] == ["0.166", "0.0972", "0.150"]
    assert [r[1] for r in rows] == ["+0.0128", "-0.0074", "0.000"]
