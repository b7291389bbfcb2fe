"""Offline text for the examples: English prose and Python source that ship with Python.

Byte-level tokens (vocabulary 256), so no tokenizer download is needed.

>>> ids = encode("Hi")
>>> ids.tolist(), ids.dtype.name
([72, 105], 'int64')
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

VOCAB_SIZE = 256


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes as int64 token ids."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def prose_text() -> str:
    """English prose: the Python documentation topics shipped in ``pydoc_data`` (about 0.5 MB)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def code_text(max_bytes: int = 2_000_000) -> str:
    """Python source from the standard library (top-level modules in sorted order, up to ``max_bytes``)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    size = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    return "\n\n".join(parts)
