"""Shared fixtures: the repository's scripts (examples, benchmarks) as modules, and the tiny models and
canaries most tests measure. Reusable model builders, data and harnesses live in ``atlas_tracking.testing``
(examples and benchmarks use them too); this file only makes them fixtures."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (``examples/``, ``benchmarks/``, ``docs/`` are read from here)."""


def load_script(relative: str) -> ModuleType:
    """A script of the repository (``examples/demo.py``, ``benchmarks/crash_safety.py``) as a module, loaded
    from its path: the tests call the scripts' own functions as the scripts do, without editing ``sys.path``."""
    path = ROOT / relative
    name = "script_" + "_".join(path.with_suffix("").parts[-2:])
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def script() -> Callable[[str], ModuleType]:
    """``script("examples/megatron_loop.py")``: a repository script as a module."""
    return load_script


@pytest.fixture
def mlflow_server(tmp_path):
    """A real ``mlflow server`` on 127.0.0.1 with a sqlite store under ``tmp_path``, stopped after the test."""
    from atlas_tracking.testing.mlflow_server import MlflowServer

    server = MlflowServer(tmp_path / "mlflow")
    server.start()
    yield server
    server.stop()


def _starts_in_background(item: pytest.Item) -> bool:
    """Whether ``item``'s module starts long runs for its tests at the session's start (``start_in_background``)."""
    return hasattr(getattr(item, "module", None), "start_in_background")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests of modules whose runs start in the background (:func:`background_runs`) come last, in their order:
    by the time they wait for their runs, the rest of the suite has run beside them."""
    items.sort(key=_starts_in_background)


@pytest.fixture(scope="session", autouse=True)
def background_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[dict[Path, dict[object, tuple[subprocess.Popen, Path]]]]:
    """With the session's first test, each selected module's ``start_in_background(tmp_path_factory)`` (its runs,
    ``{key: (process, output folder)}``, each process leading a process group of its own, started at the lowest CPU
    priority), by the module's file; a run still going when the session ends is killed with its group."""
    modules = {item.module for item in request.session.items if _starts_in_background(item)}
    started = {Path(module.__file__): module.start_in_background(tmp_path_factory) for module in modules}
    yield started
    for runs in started.values():
        for proc, _ in runs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
