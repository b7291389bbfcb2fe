"""Writing and reading artifacts: atomic file writes, JSON-ready values, headers and checksums."""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Any

import numpy as np


def jsonable(obj: Any) -> Any:
    """Numpy arrays and scalars to lists and Python numbers; non-finite floats to None."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        f = float(obj)
        return f if math.isfinite(f) else None
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


def write_atomic(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def check_header(data: Any, kind: str, max_version: int, where: str, error: type[ValueError]) -> None:
    """An artifact's ``kind`` and ``schema_version`` (a newer schema than this code reads is an error)."""
    if not isinstance(data, dict) or data.get("kind") != kind:
        raise error(f"{where} is not an {kind} artifact (missing kind={kind!r})")
    version = data.get("schema_version")
    if not isinstance(version, int) or version > max_version:
        raise error(f"{where} has schema_version {version!r}; this atlas_tracking reads versions <= {max_version}")


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
