"""A top-1 model's gates in a real offline W&B run, read back: no C2 key is logged (never 0 or NaN), and the
workspace laid out from the run's record shows "C2: n/a (top-1)" where C2 panels would be and names only keys
the run logged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from atlas_tracking.integrations.wandb_workspace import (
    TOP1_PANEL,
    build_workspace,
    logged_keys,
    record_layout,
    record_top1,
    workspace_sections,
)

from atlas_tracking.cli import main
from atlas_tracking.gate import AtlasGate
from atlas_tracking.testing.lightning_lm import build_qwen3_moe
from atlas_tracking.testing.tiny import POST_TRAINING, tiny_canary


@pytest.fixture(scope="module")
def top1_run(tmp_path_factory):
    """A baseline and one gate of a top-1 Qwen3-MoE (num_experts_per_tok = 1) logged to an offline W&B run."""
    import wandb
    from atlas_tracking.integrations.wandb import WandbSink

    from atlas_tracking.testing.wandb_offline import wait_for_offline_run

    tmp = tmp_path_factory.mktemp("wandb_top1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        run = wandb.init(project="atlas-test", dir=str(tmp), mode="offline")
        model = build_qwen3_moe(seed=0, hidden=32, layers=2, experts=8, top_k=1, aux_coef=0.0).eval()
        gate = AtlasGate(model, tiny_canary(), POST_TRAINING, out_dir=tmp / "atlas", sinks=[WandbSink(run=run)])
        gate.run(0, loss=4.0)
        torch.manual_seed(3)
        with torch.no_grad():
            weight = model.model.layers[0].mlp.gate.weight
            weight.add_(torch.randn_like(weight) * weight.std())
        model.train()(torch.randint(0, 256, (4, 32)))  # a training forward (gradients on): an interval between gates
        gate.run(10, loss=3.5)
        gate.finish()
        run_dir = Path(run.dir).parent
        run.finish()
    data = wait_for_offline_run(run_dir)
    assert data["complete"]
    return data, len(gate.layers), tmp / "atlas" / "gates.jsonl"


def test_no_c2_key_is_logged_at_top1(top1_run):
    data, _, record = top1_run
    rows = [row for row in data["history"] if "atlas/status_code" in row]
    assert len(rows) == 2
    keys = set().union(*(row.keys() for row in rows))
    assert not [k for k in keys if k.split("/")[-1].startswith("c2")]
    assert {"atlas/dead_experts", "atlas/min_entropy", "atlas/handoff_margin", "atlas/layer_01/load_cv"} <= keys
    assert rows[1]["atlas/layers"]["_type"] == "table-file"
    assert all(json.loads(line)["c2_absent"] == "top-1 routing" for line in record.read_text().splitlines())


def test_the_top1_workspace_names_only_logged_keys_and_says_na(top1_run):
    data, n_layers, record = top1_run
    assert record_top1(record)
    n_read, groups = record_layout(record)
    sections = workspace_sections(n_read, groups, top1=True)
    keys = set().union(*(row.keys() for row in data["history"]))
    supervised = [s for s in sections if not s.name.startswith("atlas: rollout")]  # a reinforcement-learning loop's
    assert logged_keys(supervised) - keys == set()
    titles = [[p.title for p in s.panels] for s in sections]
    assert [t.count("C2: n/a (top-1)") for t in titles] == [1, 0, 0, 1, 0, 0, 0, 1]  # the coupling section has none
    workspace = build_workspace("an-entity", "a-project", n_layers, top1=True)
    assert TOP1_PANEL.text.split(".")[0].strip("*") in json.dumps(workspace._to_model().model_dump(mode="json"))


def test_cli_prints_the_top1_layout_from_the_record(top1_run, capsys):
    _, _, record = top1_run
    assert main(["wandb-workspace", "--entity", "e", "--project", "p", "--record", str(record), "--print"]) == 0
    printed = json.loads(capsys.readouterr().out)
    panels = [p for s in printed for p in s["panels"]]
    assert not [k for p in panels for k in p["keys"] if k.split("/")[-1].startswith("c2")]
    assert sum(p["kind"] == "markdown" and p["title"] == "C2: n/a (top-1)" for p in panels) == 3
