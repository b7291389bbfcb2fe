"""Under torch.distributed only rank zero prints a gate's canary progress."""

from __future__ import annotations

import pytest

from atlas_tracking.testing import parallel_models as pm
from atlas_tracking.testing.distributed import run_workers


@pytest.mark.slow
def test_only_rank_zero_prints_canary_progress():
    printed = run_workers(pm.gate_stderr, 2, timeout=300)
    assert "canary windows" in printed[0]
    assert "canary windows" not in printed[1], printed[1]
