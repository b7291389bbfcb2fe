"""Shared fixtures: the repository's scripts (examples, benchmarks) as modules, and the tiny models and
canaries most tests measure. Reusable model builders, data and harnesses live in ``atlas_tracking.testing``
(examples and benchmarks use them too); this file only makes them fixtures."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
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
