"""The viz tests' shared run: a real baseline gate and a bad gate after it (:mod:`atlas_tracking.testing.overload`)."""

from __future__ import annotations

import pytest

from atlas_tracking.gate import AtlasGate
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.overload import STRICT, overload_expert
from atlas_tracking.testing.tiny import random_canary


@pytest.fixture(scope="session")
def overloaded_run(tmp_path_factory):
    """A baseline, then a gate after one expert per layer was made to take more routes: CV up, no dead expert."""
    out = tmp_path_factory.mktemp("run")
    model, canary = family_model("qwen3_moe"), random_canary(n=8)
    gate = AtlasGate(model, canary, STRICT, out_dir=out / "atlas")
    base = gate.run(0, loss=4.0)
    overload_expert(model, canary, expert=1, shift=12.0)
    last = gate.run(10, loss=3.9)
    return {"dir": out, "records": [base, last]}
