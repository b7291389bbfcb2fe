"""Tensors written row block by row block to an unnamed temporary file as a gate collects them (docs/record.md#baselines-on-disk).

A gate that makes a baseline collects, in every micro-batch and routed layer, the rows of the anchors that micro-batch
holds. A :class:`TensorSpool` takes each block of rows to the host and appends it to a file as it comes, so the
anchors are never all in memory: the baseline is read back from the spool one tensor at a time when it is written
(or a row range at a time when a later gate reads it before it is saved). The file is unnamed
(``tempfile.TemporaryFile`` in the system's temporary directory, ``TMPDIR``): nothing is left on disk when the
spool is let go or the process dies. Several ranks' spools join into one (:meth:`TensorSpool.joined`); a spool
sent to another process carries its bytes with it and is held in that process's memory.

>>> import torch
>>> spool = TensorSpool()
>>> spool.add("a", 2, torch.tensor([[4.0, 5.0]]))
>>> spool.add("a", 0, torch.tensor([[0.0, 1.0], [2.0, 3.0]]))
>>> spool["a"].tolist(), spool.meta("a"), spool.rows(["a"], 1, 3)["a"].tolist()
([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], (torch.float32, (3, 2)), [[2.0, 3.0], [4.0, 5.0]])
"""

from __future__ import annotations

import io
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from atlas_tracking.artifacts.tensor_file import nbytes


@dataclass(frozen=True)
class _Block:
    """Rows ``start:start + rows`` of one tensor, at byte ``offset`` of file ``file``."""

    start: int
    rows: int
    file: int
    offset: int


def _length(ordered: list[_Block]) -> int:
    """Rows of a tensor from its blocks in row order."""
    return ordered[-1].start + ordered[-1].rows


class _File:
    """One file of blocks, closed (an unnamed temporary file is then gone) once no spool holds it."""

    def __init__(self, fh: BinaryIO):
        self.fh = fh

    def __del__(self) -> None:
        self.fh.close()


class TensorSpool(Mapping[str, torch.Tensor]):
    """Named tensors assembled from row blocks appended to temporary files; ``spool[name]`` reads one whole tensor,
    :meth:`rows` a row range of several, :meth:`meta` a tensor's dtype and shape without reading it."""

    def __init__(self) -> None:
        self._files: list[_File] = []
        self._own: int | None = None
        """The file :meth:`add` appends to (created at the first block; a joined spool's are its sources')."""
        self._blocks: dict[str, list[_Block]] = {}
        self._kind: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        """Each tensor's dtype and the shape of one row."""

    def add(self, name: str, start: int, rows: torch.Tensor) -> None:
        """Append ``rows`` (copied to the host) as rows ``start:start + len(rows)`` of tensor ``name``."""
        kind = (rows.dtype, tuple(rows.shape[1:]))
        if self._kind.setdefault(name, kind) != kind:
            raise ValueError(f"spooled tensor {name!r} holds rows of {self._kind[name]}, not {kind}")
        if self._own is None:
            self._own = len(self._files)
            self._files.append(_File(tempfile.TemporaryFile()))  # noqa: SIM115 (closed with the last spool holding it)
        fh = self._files[self._own].fh
        offset = fh.seek(0, io.SEEK_END)
        host = rows.detach().contiguous()
        host = host if host.device.type == "cpu" else host.cpu()  # a gate hands host rows (engine/transfer.py)
        fh.write(host.reshape(-1).view(torch.uint8).numpy().data)
        self._blocks.setdefault(name, []).append(_Block(start, rows.shape[0], self._own, offset))

    @classmethod
    def joined(cls, spools: list[TensorSpool]) -> TensorSpool:
        """One spool holding the blocks of all ``spools`` (their files are shared, not copied)."""
        out = cls()
        for spool in spools:
            base = len(out._files)
            out._files.extend(spool._files)
            for name, blocks in spool._blocks.items():
                kind = out._kind.setdefault(name, spool._kind[name])
                if kind != spool._kind[name]:
                    raise ValueError(f"spooled tensor {name!r} holds rows of {kind} and of {spool._kind[name]}")
                out._blocks.setdefault(name, []).extend(
                    _Block(b.start, b.rows, base + b.file, b.offset) for b in blocks)
        return out

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """``(dtype, shape)`` of tensor ``name``, from the blocks' records (no data read)."""
        dtype, row = self._kind[name]
        return dtype, (_length(self._ordered(name)), *row)

    def _ordered(self, name: str) -> list[_Block]:
        """The blocks of ``name`` in row order; an error unless they tile rows ``0:n`` exactly."""
        blocks = sorted(self._blocks[name], key=lambda b: b.start)
        end = 0
        for b in blocks:
            if b.start != end:
                raise ValueError(f"spooled tensor {name!r} has rows {end}:{b.start} missing or written twice")
            end += b.rows
        return blocks

    def _read(self, name: str, block: _Block, lo: int, hi: int, into: torch.Tensor) -> None:
        """Rows ``lo:hi`` (within ``block``) of ``name`` read into ``into``."""
        row_bytes = nbytes(*self._kind[name])
        fh = self._files[block.file].fh
        fh.seek(block.offset + (lo - block.start) * row_bytes)
        target = into.view(-1).view(torch.uint8).numpy()
        if fh.readinto(target) != target.nbytes:
            raise OSError(f"spooled tensor {name!r}: its temporary file ended early")

    def rows(self, names: list[str], start: int, end: int) -> dict[str, torch.Tensor]:
        """Rows ``start:end`` of each tensor in ``names``, read from the blocks that hold them."""
        out = {}
        for name in names:
            dtype, row = self._kind[name]
            blocks = self._ordered(name)
            end_n = min(end, _length(blocks))
            t = torch.empty((max(0, end_n - start), *row), dtype=dtype)
            for b in blocks:
                lo, hi = max(start, b.start), min(end_n, b.start + b.rows)
                if lo < hi:
                    self._read(name, b, lo, hi, t[lo - start : hi - start])
            out[name] = t
        return out

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._blocks:
            raise KeyError(name)
        return self.rows([name], 0, self.meta(name)[1][0])[name]

    def __contains__(self, name: object) -> bool:
        return name in self._blocks

    def __iter__(self) -> Iterator[str]:
        return iter(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def __getstate__(self) -> dict[str, Any]:
        """Sent to another process (a distributed gate's gather): the blocks' bytes go with it, read into one buffer."""
        data, blocks = io.BytesIO(), {}
        for name, own in self._blocks.items():  # block by block: one rank's spool holds only its own rows
            dtype, row = self._kind[name]
            blocks[name] = []
            for b in own:
                rows = torch.empty((b.rows, *row), dtype=dtype)
                self._read(name, b, b.start, b.start + b.rows, rows)
                blocks[name].append(_Block(b.start, b.rows, 0, data.tell()))
                data.write(rows.reshape(-1).view(torch.uint8).numpy().data)
        return {"blocks": blocks, "kind": self._kind, "data": data.getvalue()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._files, self._own = [_File(io.BytesIO(state["data"]))], None
        self._blocks, self._kind = state["blocks"], state["kind"]
