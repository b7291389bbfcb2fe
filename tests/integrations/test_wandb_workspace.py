"""The W&B workspace layout: built offline with wandb-workspaces, and naming only keys a real run logs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from atlas_tracking.integrations.wandb_workspace import (
    build_workspace,
    logged_keys,
    record_layout,
    workspace_sections,
)

from atlas_tracking.cli import main
from atlas_tracking.engine.rollout import trainer_routes
from atlas_tracking.gate import AtlasGate
from atlas_tracking.testing.tiny import POST_TRAINING, tiny_canary, tiny_module


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """A real offline W&B run holding two post-training gates (a baseline and one gate against it, so every key of
    the layout, the predicates' included, is logged), read back."""
    import wandb
    from atlas_tracking.integrations.wandb import WandbSink

    from atlas_tracking.testing.wandb_offline import wait_for_offline_run

    tmp = tmp_path_factory.mktemp("wandb")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        run = wandb.init(project="atlas-test", dir=str(tmp), mode="offline")
        module = tiny_module()
        gate = AtlasGate(module.model, tiny_canary(), POST_TRAINING, out_dir=tmp / "atlas",
                         sinks=[WandbSink(run=run)])
        gate.run(0, loss=4.0)
        with torch.no_grad():
            weight = module.model.model.layers[0].mlp.gate.weight  # move the router so drift keys are non-zero
            weight.add_(weight.std() * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
        module.model.train()(torch.randint(0, 256, (4, 32)))  # a training forward (gradients on): an interval between gates
        gate.run(10, loss=3.5)
        ids = torch.randint(0, 256, (2, 16))
        gate.rollout(10, ids, trainer_routes(module.model, ids), rollout_logprobs=torch.full((2, 16), -5.0))
        gate.finish()  # tracker calls run in the background: the end of training waits for them
        run_dir = Path(run.dir).parent
        run.finish()
    data = wait_for_offline_run(run_dir)
    assert data["complete"]
    return data, len(gate.layers), tmp / "atlas" / "gates.jsonl"


def test_layout_names_only_keys_the_sink_logs(logged_run):
    data, n_layers, record = logged_run
    layers_read, groups = record_layout(record)
    assert layers_read == n_layers
    assert groups == ("router", "experts", "attention", "norms", "embeddings")  # the tiny model has no "other"
    keys = set().union(*(row.keys() for row in data["history"]))
    wanted = logged_keys(workspace_sections(n_layers, groups))
    assert wanted - keys == set()
    # and it shows every scalar the sink logs, per-layer ones behind their own section
    scalars = {k for row in data["history"] for k, v in row.items() if k.startswith("atlas/") and isinstance(v, float)}
    assert scalars - wanted == set()


def test_per_layer_series_stay_in_their_own_closed_section(logged_run):
    _, n_layers, _ = logged_run
    sections = workspace_sections(n_layers)
    per_layer = re.compile(r"atlas/layer_\d+/")
    rollout = [s for s in sections if s.name.startswith("atlas: rollout")]
    assert len(rollout) == 1 and not rollout[0].is_open          # reinforcement-learning runs only
    for section in sections[:-1]:
        assert section.is_open or section in rollout
        assert not any(per_layer.match(k) for p in section.panels for k in p.keys)
    assert not sections[-1].is_open
    assert any(per_layer.match(k) for p in sections[-1].panels for k in p.keys)


def test_workspace_builds_offline_and_its_panels_read_the_layout_keys(logged_run):
    _, n_layers, _ = logged_run
    workspace = build_workspace("an-entity", "a-project", n_layers)
    model = json.dumps(workspace._to_model().model_dump(by_alias=True, mode="json"))
    assert workspace.auto_generate_panels is False
    for key in logged_keys(workspace_sections(n_layers)):
        assert json.dumps(key)[1:-1] in model, key
    assert [s.name for s in workspace.sections] == [s.name for s in workspace_sections(n_layers)]


def test_cli_prints_the_layout_from_a_record_without_contacting_wandb(logged_run, capsys):
    _, n_layers, record = logged_run
    assert main(["wandb-workspace", "--entity", "e", "--project", "p", "--record", str(record), "--print"]) == 0
    printed = json.loads(capsys.readouterr().out)
    layer_keys = {k for s in printed for p in s["panels"] for k in p["keys"] if k.startswith("atlas/layer_")}
    assert {k.split("/")[1] for k in layer_keys} == {f"layer_{i:02d}" for i in range(n_layers)}


def test_cli_refuses_an_empty_record(tmp_path, capsys):
    empty = tmp_path / "gates.jsonl"
    empty.write_text("")
    assert main(["wandb-workspace", "--entity", "e", "--project", "p", "--record", str(empty), "--print"]) == 2
    assert "holds no gate record" in capsys.readouterr().err


def test_saving_without_a_wandb_login_is_one_line_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "config"), NETRC=str(tmp_path / "netrc"))
    proc = subprocess.run([sys.executable, "-m", "atlas_tracking.cli", "wandb-workspace", "--entity", "e", "--project",
                           "p", "--layers", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atlas-tracking wandb-workspace: error: log in to W&B first")
