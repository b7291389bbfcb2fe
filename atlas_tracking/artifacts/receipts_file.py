"""The two on-disk forms of a receipts artifact: JSON text and a compact safetensors file.

Both hold the same document (docs/record.md#receipts-artifacts). The safetensors form stores every numeric
array of ``per_window`` as a tensor named by its path in the document (``per_window/layers/3/load``), in a dtype
that gives back exactly the numbers the JSON form holds (integers in the narrowest integer dtype that holds
them; floats as float32 when every value is a float32, else float64; a ``null`` as NaN), and the rest of the
document, with a null where each tensor goes, as JSON in the file's metadata. Reading either form gives the
same dict.

Example:
    >>> doc = {"kind": "atlas-receipts", "per_window": {"layers": [{"load": [[3, 0], [1, 2]],
    ...        "c2": {"sum": [0.5, None], "count": [2, 0]}, "x": [0.1, 1]}], "n": 4}}
    >>> form, data = encode(doc, "safetensors", 0)
    >>> sorted(split(doc)[1])
    ['per_window/layers/0/c2/count', 'per_window/layers/0/c2/sum', 'per_window/layers/0/load']
    >>> decode(data, "r.safetensors") == doc
    True
    >>> encode(doc, "auto", 100) == ("json", json.dumps(doc, separators=(",", ":"), allow_nan=False).encode())
    True
    >>> encode(doc, "auto", 5)[0]
    'safetensors'
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Literal

import numpy as np

FORMS = {".json": "json", ".safetensors": "safetensors"}
"""File suffix -> form of a receipts artifact (``receipts/step_N.json`` or ``receipts/step_N.safetensors``)."""

SUFFIXES = {form: suffix for suffix, form in FORMS.items()}
"""Form -> file suffix."""

Format = Literal["auto", "json", "safetensors"]

_DOCUMENT = "document"
"""The metadata key of the safetensors form: the document without its tensors."""


def form_of(path: str | Path) -> str:
    """The form a receipts artifact's name says (``json`` for any suffix but ``.safetensors``).

    >>> form_of("receipts/step_00000010.safetensors"), form_of("receipts.json")
    ('safetensors', 'json')
    """
    return FORMS.get(Path(path).suffix, "json")


_INTEGERS = (np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64)
"""Integer dtypes, narrowest first: an integer array is stored in the first that holds every value."""


def _array(values: list[Any]) -> np.ndarray | None:
    """``values`` as an array that gives them back exactly, or None when they are not a rectangular array of
    integers (no booleans) or of floats and nulls."""
    try:
        cells = np.asarray(values, dtype=object)
    except ValueError:  # ragged
        return None
    kinds = set(map(type, cells.flat))
    if cells.size == 0 or not cells.ndim:
        return None
    if kinds == {int}:
        try:
            wide = np.asarray(values, dtype=np.int64)
        except OverflowError:
            return None
        lo, hi = int(wide.min()), int(wide.max())
        return next(wide.astype(t) for t in _INTEGERS if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max)
    if float in kinds and kinds <= {float, type(None)}:
        wide = np.asarray(values, dtype=np.float64)  # None -> NaN (the JSON form holds no NaN)
        with np.errstate(over="ignore"):
            narrow = wide.astype(np.float32)
        return narrow if np.array_equal(narrow.astype(np.float64), wide, equal_nan=True) else wide
    return None


def split(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``doc`` with each numeric array of ``per_window`` replaced by None, and the arrays named by their path
    (dict keys and list positions joined by ``/``; an array under a key holding ``/`` stays in the document)."""
    tensors: dict[str, np.ndarray] = {}

    def walk(node: Any, path: list[str]) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, [*path, k]) for k, v in node.items()}
        if not isinstance(node, list):
            return node
        array = _array(node)
        name = "/".join(path)
        if array is None or any("/" in part for part in path):
            return [walk(v, [*path, str(i)]) for i, v in enumerate(node)]
        tensors[name] = array
        return None

    rest = {k: (walk(v, [k]) if k == "per_window" else v) for k, v in doc.items()}
    return rest, tensors


def encode(doc: dict[str, Any], form: Format, binary_above: int) -> tuple[str, bytes]:
    """The form written and the bytes of a JSON-ready receipts document; ``auto`` writes safetensors when the
    numeric arrays of ``per_window`` hold more than ``binary_above`` values, else the JSON text."""
    if form != "json":
        rest, tensors = split(doc)
        if form == "safetensors" or sum(a.size for a in tensors.values()) > binary_above:
            from safetensors.numpy import save

            return "safetensors", save(tensors, metadata={_DOCUMENT: json.dumps(rest, separators=(",", ":"),
                                                                                 allow_nan=False)})
    return "json", json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


class FormError(ValueError):
    """The bytes of a receipts artifact are not a whole artifact of the form its name says (the message completes
    "receipts artifact PATH is ...")."""


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's header (its first 8 bytes give the header's length)."""
    if len(data) < 8:
        raise FormError(f"not a whole safetensors file (truncated?): {len(data)} bytes, shorter than its header length")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise FormError(f"not a whole safetensors file (truncated?): its header length is {size} bytes, "
                        f"{len(data) - 8} follow")
    try:
        header = json.loads(data[8:8 + size])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FormError(f"not a whole safetensors file (corrupted?): its header is not valid JSON: {exc}") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or _DOCUMENT not in meta:
        raise FormError("a safetensors file without a receipts document in its header (not a receipts artifact)")
    return meta


def _values(array: np.ndarray) -> list[Any]:
    """The JSON form's values of a stored array (NaN back to None)."""
    if array.dtype.kind != "f":
        return array.tolist()
    cells = array.astype(np.float64).astype(object)
    cells[np.isnan(array)] = None
    return cells.tolist()


def decode(data: bytes, where: str) -> dict[str, Any]:
    """The document of the bytes of a receipts artifact whose name is ``where`` (its form by its suffix)."""
    if form_of(where) == "json":
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise FormError(f"not valid JSON (truncated or corrupted?): {exc}") from None
    meta = _metadata(data)
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        tensors = load(data)
        doc = json.loads(meta[_DOCUMENT])
    except (SafetensorError, json.JSONDecodeError) as exc:
        raise FormError(f"not a whole safetensors file (truncated or corrupted?): {exc}") from None
    for name, array in tensors.items():
        node, parts = doc, name.split("/")
        try:
            for part in parts[:-1]:
                node = node[int(part) if isinstance(node, list) else part]
            last = parts[-1]
            if (node[int(last)] if isinstance(node, list) else node[last]) is not None:
                raise KeyError(last)
            node[int(last) if isinstance(node, list) else last] = _values(array)
        except (KeyError, IndexError, TypeError, ValueError):
            raise FormError(f"corrupted: tensor {name!r} has no place in its document") from None
    return doc
