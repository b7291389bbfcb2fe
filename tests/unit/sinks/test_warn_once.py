"""A warning for the operator is said once: a Python warning, not also a log line of its own."""

from __future__ import annotations

import logging
import warnings

from atlas_tracking.gate import AtlasGate
from atlas_tracking.sinks.delivery import warn_operator
from atlas_tracking.testing.tiny import QUIET, tiny_canary, tiny_module


def _said(caplog, recorded, needle: str) -> int:
    logged = [r for r in caplog.records if needle in r.getMessage()]
    warned = [w for w in recorded if needle in str(w.message)]
    return len(logged) + len(warned)


def test_tracker_trouble_is_said_once(caplog):
    with caplog.at_level(logging.INFO, logger="atlas_tracking"), warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        warn_operator("atlas: mlflow did not receive gate step 10")
    assert _said(caplog, recorded, "did not receive gate step 10") == 1


def test_a_record_of_another_run_is_said_once(tmp_path, caplog):
    model, canary = tiny_module().model, tiny_canary()
    AtlasGate(model, canary, QUIET, out_dir=tmp_path / "atlas").run(0, loss=1.0)
    with caplog.at_level(logging.INFO, logger="atlas_tracking"), warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        AtlasGate(model, canary, QUIET, out_dir=tmp_path / "atlas").run(0, loss=1.0)
    assert _said(caplog, recorded, "holds the record of another run") == 1
