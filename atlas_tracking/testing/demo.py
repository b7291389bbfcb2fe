"""What the main job (``examples/demo.py``) shares with its variants, the tests and the benchmarks.

The demo's embedded configuration, its text streams (prose and Python source that ship with Python), the
canary every run is measured on (the gate table it prints is :func:`atlas_tracking.viz.gate_table.gate_table`).

Example:
    >>> DEMO_CONFIG["policy"]["c2_tol"]
    0.025
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from atlas_tracking.artifacts.history import read_history
from atlas_tracking.engine.canary import Canary
from atlas_tracking.testing.demo_data import code_text, encode, prose_text

DEMO_CONFIG: dict[str, Any] = {
    "receipts": {"progress": False, "anchors": 512},
    "lifecycle": {"protected_layers": "auto"},
    "policy": {"c2_tol": 0.025, "dead_tol": 5.0, "entropy_tol": 0.15, "cv_tol": 15.0, "n_recover": 2},
    "alerts": {"rules": [{"metric": "dead_experts", "op": ">", "value": 12, "scope": "any_protected_layer",
                          "level": "WARN", "min_interval_steps": 400}]},
}
"""Embedded atlas config of the demo (the same keys a user puts in atlas.yaml)."""


def _split(stream: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a, b = int(0.8 * len(stream)), int(0.9 * len(stream))
    return stream[:a], stream[a:b], stream[b:]


def data() -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Train, validation and held-out streams of the prose and of the Python source."""
    return {"prose": _split(encode(prose_text())), "code": _split(encode(code_text(1_500_000)))}


def demo_canary(streams: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None) -> Canary:
    """The canary of every run: 64 windows of 128 tokens from the held-out prose (``streams`` from :func:`data`)."""
    return Canary.from_token_ids((streams or data())["prose"][2], window=128, n_windows=64, seed=0)


def records(run_dir: Path) -> list[dict[str, Any]]:
    """The history of a demo run (``<run_dir>/atlas/gates.jsonl``)."""
    return list(read_history(run_dir / "atlas"))
