"""Checks of a run's record that several tests make: each record and the receipts file it acknowledged."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from atlas_tracking.artifacts.gate_report import read_artifact
from atlas_tracking.artifacts.run_dir import RunDir


def assert_receipts_match(atlas: Path, records: list[dict[str, Any]]) -> None:
    """Each record's receipts file holds exactly the receipts it acknowledged (sha256 and C2)."""
    for rec in records:
        path = RunDir(atlas).receipts_file(rec["step"])  # either form (docs/record.md#receipts-artifacts)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == rec["receipts_sha256"], rec["step"]
        assert read_artifact(path)["summary"]["c2"] == rec["c2"]
