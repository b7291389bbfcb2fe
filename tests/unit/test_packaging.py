"""What the distribution declares: one version, the typing marker, the baseline format in the core."""

from __future__ import annotations

from pathlib import Path

import tomllib
from packaging.requirements import Requirement

import atlas_tracking

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_has_one_source():
    version = PYPROJECT["project"]["version"]
    assert atlas_tracking.__version__ == version
    copies = [str(p.relative_to(ROOT)) for folder in ("atlas_tracking", "integrations")
              for p in (ROOT / folder).rglob("*.py") if f'"{version}"' in p.read_text()]
    assert copies == []


def test_the_package_ships_its_typing_marker():
    assert (ROOT / "atlas_tracking" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["atlas_tracking"]


def test_the_core_and_the_wandb_extra_bring_what_they_use():
    def names(reqs):
        return {Requirement(r).name for r in reqs}

    assert "safetensors" in names(PYPROJECT["project"]["dependencies"])  # every baseline is a safetensors file
    assert {"matplotlib", "pillow"} <= names(PYPROJECT["project"]["optional-dependencies"]["wandb"])  # the heatmap
