"""Module paths of 0.1 keep working, with a DeprecationWarning, and never shadow the package's functions."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

import atlas_tracking
from atlas_tracking.compat import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_forwards_to_its_new_module(old):
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)  # a fresh stand-in, so its warning is seen here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    public = [name for name in dir(new) if not name.startswith("_")]
    assert public and all(getattr(module, name) is getattr(new, name) for name in public)
    assert any(issubclass(w.category, DeprecationWarning) and MOVED[old] in str(w.message) for w in caught)


def test_old_imports_of_0_1_still_run():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from atlas_tracking.gate_report import read_artifact, verify  # noqa: F401
        from atlas_tracking.history import read_history
        from atlas_tracking.record import gate_metrics  # noqa: F401

        from atlas_tracking.sinks import Delivery, JsonlSink  # noqa: F401
    assert read_history is atlas_tracking.read_history
    assert callable(atlas_tracking.measure) and callable(atlas_tracking.judge)
