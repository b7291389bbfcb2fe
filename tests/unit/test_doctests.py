"""Every module's docstring examples run: one test per module of the package and of its integrations.

Modules are imported by their installed names (``atlas_tracking.integrations.lightning``, not a path), so the
examples run against the same objects users import. A module whose optional framework is not installed is
skipped with the name of what is missing.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import atlas_tracking.integrations
import pytest

import atlas_tracking

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def all_modules() -> list[str]:
    """Every module of ``atlas_tracking`` (integrations included), by its import name."""
    names = ["atlas_tracking"]
    for package in (atlas_tracking, atlas_tracking.integrations):
        prefix = package.__name__ + "."
        names += [m.name for m in pkgutil.walk_packages(package.__path__, prefix) if not m.name.endswith("__main__")]
    return sorted(set(names))


MODULES = all_modules()


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] != "atlas_tracking":
            pytest.skip(f"{name} needs {exc.name}, which is not installed")
        raise
    finder, runner = doctest.DocTestFinder(exclude_empty=True), doctest.DocTestRunner(optionflags=FLAGS)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples of {name} failed (see above)"


def test_every_module_is_collected():
    """The walk reaches the modules a file listing finds: nothing is left out of the doctest run."""
    from pathlib import Path

    root = Path(atlas_tracking.__file__).parent
    on_disk = {"atlas_tracking." + ".".join(p.relative_to(root).with_suffix("").parts)
               for p in root.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    glue = Path(atlas_tracking.integrations.__file__).parent
    on_disk |= {f"atlas_tracking.integrations.{p.stem}" for p in glue.glob("*.py") if p.name != "__init__.py"}
    assert on_disk <= set(MODULES), sorted(on_disk - set(MODULES))
