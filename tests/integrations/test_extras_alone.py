"""Each extra works alone: the docs' own-MoE Lightning recipe runs in a process that can import only what
``pip install "atlas-tracking[<extras>]"`` brings (the declared dependencies of ``pyproject.toml`` and,
transitively, theirs); every other installed top-level module is blocked. The step-0 baseline is measured,
and the attached loggers (a ``CSVLogger`` alone; a ``WandbLogger`` offline) hold the atlas metrics."""

from __future__ import annotations

import csv
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from atlas_tracking.testing.wandb_offline import wait_for_offline_run

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = """
import importlib.metadata, json, os, re, sys

BLOCKED = json.loads(os.environ["ATLAS_TEST_BLOCKED"])
# a None entry is what Python reads as "not installed": import raises ModuleNotFoundError, find_spec says None
sys.modules.update(dict.fromkeys(BLOCKED["modules"]))
_discover = importlib.metadata.Distribution.discover.__func__


def _installed(cls, **kwargs):  # and their metadata is gone too (version checks read it)
    return (d for d in _discover(cls, **kwargs)
            if re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower() not in BLOCKED["distributions"])


importlib.metadata.Distribution.discover = classmethod(_installed)
"""

LOGGERS = {
    "csv": "from lightning.pytorch.loggers import CSVLogger\nloggers = [CSVLogger('logs', name='csv')]\n",
    "wandb": "from lightning.pytorch.loggers import WandbLogger\nloggers = [WandbLogger(project='atlas', save_dir='.', offline=True)]\n",
}

FIT = '''
trainer = pl.Trainer(max_steps=20, val_check_interval=10, logger=loggers, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[AtlasCallback(canary=canary, config={"receipts": {"progress": False}})])
trainer.fit(TinyLM(), train, val)
if sys.modules.get("wandb") is not None:
    print("WANDB_RUN_DIR=" + os.path.dirname(loggers[0].experiment.dir))
    sys.modules["wandb"].finish()
'''


def recipe() -> str:
    """The own-MoE recipe of docs/extending.md up to its training lines (the test trains with its loggers)."""
    text = (ROOT / "docs" / "extending.md").read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("## Your own MoE module"):], re.S).group(1)
    return code[: code.index("trainer = pl.Trainer(")]


def distributions(extras: tuple[str, ...]) -> set[str]:
    """Every distribution ``pip install "atlas-tracking[extras]"`` installs: the declared requirements of
    ``pyproject.toml`` and, transitively, the installed metadata's requirements (with their extras)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    todo = [(r, ()) for r in project["dependencies"]] + [(r, ()) for e in extras for r in optional[e]]
    seen: set[tuple[str, str]] = set()
    names = {"atlas-tracking"}
    while todo:
        text, _ = todo.pop()
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name == "atlas-tracking":
            todo += [(r, ()) for e in req.extras for r in optional[e]]
            continue
        wanted = [e for e in ("", *sorted(req.extras)) if (name, e) not in seen]
        if (req.marker is not None and not req.marker.evaluate({"extra": ""})) or not wanted:
            continue
        seen.update((name, e) for e in wanted)
        names.add(name)
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for dep in map(Requirement, requires):
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in wanted):
                todo.append((str(dep), ()))
    return names


def blocked_modules(extras: tuple[str, ...]) -> list[str]:
    """Installed top-level modules that belong to no distribution the extras bring."""
    allowed = distributions(extras)
    return sorted(module for module, dists in importlib.metadata.packages_distributions().items()
                  if module != "atlas_tracking" and not {canonicalize_name(d) for d in dists} & allowed)


def blocked(extras: tuple[str, ...]) -> dict[str, list[str]]:
    """The modules and the distributions (their metadata) the recipe's process does not see."""
    allowed = distributions(extras)
    installed = {canonicalize_name(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    return {"modules": blocked_modules(extras), "distributions": sorted(installed - allowed)}


def run_recipe(tmp_path: Path, extras: tuple[str, ...], logger: str) -> subprocess.CompletedProcess:
    script = tmp_path / "recipe.py"
    script.write_text("import os, sys\n" + BLOCKER + recipe() + LOGGERS[logger] + FIT)
    env = {**os.environ, "ATLAS_TEST_BLOCKED": json.dumps(blocked(extras)), "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def gates(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "atlas" / "gates.jsonl").read_text().splitlines()]


def test_the_blocker_hides_what_an_extra_does_not_bring():
    lightning = blocked_modules(("lightning",))
    assert {"transformers", "wandb", "mlflow", "matplotlib", "PIL", "deepspeed"} <= set(lightning)
    assert not {"torch", "numpy", "yaml", "safetensors", "lightning"} & set(lightning)
    with_wandb = blocked_modules(("lightning", "wandb"))
    assert not {"wandb", "matplotlib", "PIL"} & set(with_wandb) and "transformers" in with_wandb


@pytest.mark.slow
def test_lightning_alone_measures_the_step_0_baseline_and_a_csv_logger_gets_the_scalars(tmp_path):
    run_recipe(tmp_path, ("lightning",), "csv")
    records = gates(tmp_path)
    assert [r["step"] for r in records] == [0, 10, 20] and records[0]["status"] == "BASELINE"
    assert not (tmp_path / "atlas" / "errors.jsonl").exists()
    with open(next((tmp_path / "logs" / "csv").glob("version_*/metrics.csv"))) as fh:
        rows = [row for row in csv.DictReader(fh) if row.get("atlas/c2")]
    assert [int(row["step"]) for row in rows] == [r["log_step"] for r in records] == [0, 9, 19]
    for row, rec in zip(rows, records):
        assert float(row["atlas/c2"]) == pytest.approx(rec["c2"])
        assert float(row["atlas/status_code"]) == {"BASELINE": 0, "GREEN": 1, "YELLOW": 2, "RED": 3}[rec["status"]]


@pytest.mark.slow
def test_lightning_with_wandb_delivers_every_gate_to_wandb_offline(tmp_path):
    proc = run_recipe(tmp_path, ("lightning", "wandb"), "wandb")
    records = gates(tmp_path)
    assert [r["step"] for r in records] == [0, 10, 20] and records[0]["status"] == "BASELINE"
    run_dir = re.search(r"WANDB_RUN_DIR=(.*)", proc.stdout).group(1)
    data = wait_for_offline_run(tmp_path / run_dir)
    rows = [row for row in data["history"] if "atlas/c2" in row]
    assert [row["trainer/global_step"] for row in rows] == [r["log_step"] for r in records]
    assert [row["atlas/c2"] for row in rows] == pytest.approx([r["c2"] for r in records])
    assert all(row["atlas/c2_heatmap"]["_type"] == "image-file" for row in rows)
    assert data["summary"]["atlas/stage"] == records[-1]["stage"]
