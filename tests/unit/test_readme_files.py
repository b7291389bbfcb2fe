"""Every file the README's Python snippets name ships in the repository, a named config loads, and the Lightning
lines run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from atlas_tracking import AtlasConfig

ROOT = Path(__file__).resolve().parents[2]


def named_files(markdown: str) -> list[str]:
    """String literals of the Python blocks that name a file (a config, a canary, an artifact)."""
    blocks = re.findall(r"```python\n(.*?)```", markdown, re.S)
    return [name for block in blocks for name in re.findall(r"\"([\w./-]+\.(?:ya?ml|npz|npy))\"", block)]


def test_the_readme_snippets_name_only_shipped_files_and_the_config_loads():
    names = named_files((ROOT / "README.md").read_text())
    assert "examples/atlas.yaml" in names
    for name in names:
        assert (ROOT / name).is_file(), f"README.md names {name}, which does not ship"
        if name.endswith((".yaml", ".yml")):
            AtlasConfig.from_yaml(ROOT / name)


def lightning_snippet() -> str:
    """The README's Lightning block, as written."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Lightning (five lines)"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_readme_lightning_lines_run_with_the_shipped_config(tmp_path, monkeypatch):
    """The five lines, run as written in a checkout (the prelude supplies what they assume: token ids, ``L`` and
    the two loggers; W&B offline, MLflow on sqlite), then a short fit: every validation runs a gate."""
    import json

    import lightning.pytorch as L
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

    from atlas_tracking.testing.tiny import PROSE, tiny_data, tiny_module

    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the README's paths are relative to the checkout
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    scope = {"token_ids": PROSE[300_000:], "L": L, "WandbLogger": WandbLogger, "MLFlowLogger": MLFlowLogger}
    exec(compile(lightning_snippet(), "README.md", "exec"), scope)
    trainer = scope["trainer"]
    trainer.fit_loop.max_epochs = 2  # a short fit: two epochs of two steps, a validation after each
    train, val = tiny_data(2)
    try:
        trainer.fit(tiny_module(), train, val)
    finally:
        import wandb

        wandb.finish()
    gates = [json.loads(line) for line in (tmp_path / "atlas" / "gates.jsonl").read_text().splitlines()]
    assert [g["step"] for g in gates] == [0, 2, 4] and gates[0]["status"] == "BASELINE"
