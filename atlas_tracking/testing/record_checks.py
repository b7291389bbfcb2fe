"""Checks of a run's record that several tests make: each record and the receipts file it acknowledged."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def assert_receipts_match(atlas: Path, records: list[dict[str, Any]]) -> None:
    """Each record's receipts file holds exactly the receipts it acknowledged (sha256 and C2)."""
    for rec in records:
        path = atlas / "receipts" / f"step_{rec['step']:08d}.json"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == rec["receipts_sha256"], rec["step"]
        assert json.loads(path.read_text())["summary"]["c2"] == rec["c2"]
