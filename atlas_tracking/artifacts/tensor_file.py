"""A checked safetensors file read key by key from a memory map, never whole (docs/record.md#baselines-on-disk).

A baseline's anchor tensors take up to ``receipts.baseline_budget_bytes`` (1 GB by default). :meth:`TensorFile.hashed`
streams the file's sha256 in :data:`BLOCK_BYTES` blocks for the caller to check, and the file then reads only the
rows a caller asks for: each read opens the file memory-mapped (``safetensors.safe_open``), copies those rows out
and closes it again, so no page of the file stays mapped between reads. A read first checks that the path still
names the file that was checked (device, inode, size, modification time); a file replaced or removed since is
an error, never other tensors read silently.

>>> import tempfile, torch
>>> from safetensors.torch import save_file
>>> path = tempfile.mkdtemp() + "/t.safetensors"
>>> save_file({"a": torch.arange(6.0).view(3, 2), "b": torch.ones(3, dtype=torch.uint8)}, path)
>>> f, digest = TensorFile.hashed(path, ValueError)
>>> digest == hashlib.sha256(open(path, "rb").read()).hexdigest(), sorted(f), f.shape("a"), "c" in f
(True, ['a', 'b'], (3, 2), False)
>>> f.rows(["a", "b"], 1, 3)["a"].tolist(), read_rows({"a": torch.arange(4)}, ["a"], 1, 3)["a"].tolist()
([[2.0, 3.0], [4.0, 5.0]], [1, 2])
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
from collections.abc import Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any, BinaryIO

import torch

BLOCK_BYTES = 8 << 20
"""The block size a file's sha256 is streamed in: its memory is this, whatever the file's size."""


def stream_sha256(fh: BinaryIO) -> str:
    """The sha256 of an open binary file from its current position to its end, read in :data:`BLOCK_BYTES` blocks.

    >>> import io
    >>> stream_sha256(io.BytesIO(b"abc")) == hashlib.sha256(b"abc").hexdigest()
    True
    """
    h = hashlib.sha256()
    for block in iter(lambda: fh.read(BLOCK_BYTES), b""):
        h.update(block)
    return h.hexdigest()


_DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL"}
"""The safetensors format's names of the dtypes a tensor file holds."""


def safetensors_chunks(tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> Iterator[bytes | memoryview]:
    """The bytes of a safetensors file holding ``tensors`` (and the string ``metadata``), in chunks: the header,
    then each tensor's data in turn, copied to the host one tensor at a time. Written with
    ``artifacts.io.write_atomic``, a file is never in memory whole; safetensors reads it like one of its own.

    >>> import tempfile
    >>> from safetensors.torch import load_file
    >>> from atlas_tracking.artifacts.io import write_atomic
    >>> path = write_atomic(Path(tempfile.mkdtemp()) / "t.safetensors",
    ...                     safetensors_chunks({"a": torch.arange(6.0).view(3, 2), "b": torch.ones(2, dtype=torch.uint8)}, {}))
    >>> {key: t.tolist() for key, t in load_file(path).items()}
    {'a': [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], 'b': [1, 1]}
    """
    if sys.byteorder != "little":
        raise OSError("safetensors files are little-endian; this host is not")
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in tensors:
        dtype, shape = tensor_meta(tensors, name)
        size = nbytes(dtype, shape)
        header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    yield struct.pack("<Q", len(head)) + head
    for t in tensors.values():
        yield t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape`` (no tensor is made).

    >>> nbytes(torch.bfloat16, (3, 2)), nbytes(torch.bool, ())
    (12, 1)
    """
    return math.prod(shape) * dtype.itemsize


def tensor_meta(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[torch.dtype, tuple[int, ...]]:
    """``(dtype, shape)`` of ``tensors[name]``: from the mapping's own records where it keeps them (``meta``: a
    :class:`TensorFile`, a ``TensorSpool``), with no data read; else from the tensor."""
    meta = getattr(tensors, "meta", None)
    if meta is not None:
        return meta(name)
    t = tensors[name]
    return t.dtype, tuple(t.shape)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What names one version of a file: device, inode, size and modification time."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class TensorFile(Mapping[str, torch.Tensor]):
    """The tensors of one safetensors file, read on demand: ``f[key]`` reads one whole tensor, :meth:`rows` a row
    range of several; nothing is kept between reads."""

    def __init__(self, path: str | Path, identity: tuple[int, int, int, int], error: type[Exception]):
        self.path = Path(path)
        self.identity = identity
        """:func:`_identity` of the file when it was checked."""
        self.error = error
        """The error a read raises when the path no longer names the checked file."""

    @cached_property
    def _meta(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Every tensor's dtype and shape, from the file's header (read at the first use, after the caller's
        checksum)."""
        dtypes = {code: dtype for dtype, code in _DTYPE_CODES.items()}
        with self._open() as f:
            slices = {key: f.get_slice(key) for key in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
            return {key: (dtypes[t.get_dtype()], tuple(t.get_shape())) for key, t in slices.items()}

    @classmethod
    def hashed(cls, path: str | Path, error: type[Exception]) -> tuple[TensorFile, str]:
        """The file at ``path`` and the sha256 of the very version read (compare it to the expected one)."""
        with open(path, "rb") as fh:
            identity = _identity(os.fstat(fh.fileno()))
            digest = stream_sha256(fh)
        return cls(path, identity, error), digest

    def _open(self) -> Any:
        """The file memory-mapped for one read, after checking it is still the version checked."""
        from safetensors import safe_open

        try:
            now = _identity(os.stat(self.path))
        except OSError:
            now = None
        if now != self.identity:
            raise self.error(f"tensor file {self.path} was replaced or removed after it was checked; "
                             "load it again to read the file there now")
        return safe_open(str(self.path), framework="pt")

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of tensor ``key``, from the file's header (no data read)."""
        return self._meta[key][1]

    def meta(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """``(dtype, shape)`` of tensor ``key``, from the file's header (no data read)."""
        return self._meta[key]

    def rows(self, keys: list[str], start: int, end: int) -> dict[str, torch.Tensor]:
        """Rows ``start:end`` (along the first dimension) of each tensor in ``keys``, in one opening of the file."""
        with self._open() as f:
            return {key: f.get_slice(key)[start:end] for key in keys}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._meta:
            raise KeyError(key)
        with self._open() as f:
            return f.get_tensor(key)

    def __contains__(self, key: object) -> bool:
        return key in self._meta

    def __iter__(self) -> Iterator[str]:
        return iter(self._meta)

    def __len__(self) -> int:
        return len(self._meta)


def read_rows(tensors: Mapping[str, torch.Tensor], keys: list[str], start: int, end: int) -> dict[str, torch.Tensor]:
    """Rows ``start:end`` of each tensor in ``keys``: read from the file for a mapping that reads row ranges itself
    (``rows``: a :class:`TensorFile`, a ``TensorSpool``), sliced otherwise."""
    rows = getattr(tensors, "rows", None)
    if rows is not None:
        return rows(keys, start, end)
    return {key: tensors[key][start:end] for key in keys}
