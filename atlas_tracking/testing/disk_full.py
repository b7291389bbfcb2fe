"""A full disk without root: a file system shim that runs out of space under one folder, at chosen moments.

A small tmpfs needs root to mount; this shim gives the same failures to the code that writes a run's record:
while :attr:`Disk.free` is a number, ``os.write`` to a file under ``root`` writes only what fits and then raises
``OSError(ENOSPC)`` (a write cut part-way, as a real full disk cuts it), and ``shutil.disk_usage`` under ``root``
reports that free space. Every write of the record goes through ``os.write`` (:func:`~atlas_tracking.artifacts.io.write_all`);
writes elsewhere (the training's own files, the tests') are untouched.

Example:
    >>> import os, tempfile
    >>> root = tempfile.mkdtemp()
    >>> disk = Disk(root)
    >>> with disk.mounted():
    ...     disk.room(3)
    ...     fd = os.open(os.path.join(root, "f"), os.O_WRONLY | os.O_CREAT)
    ...     wrote = os.write(fd, b"abcdef")
    ...     try:
    ...         os.write(fd, b"def")
    ...     except OSError as exc:
    ...         error = exc.errno
    ...     os.close(fd)
    >>> wrote, error == errno.ENOSPC, open(os.path.join(root, "f")).read(), disk.refused
    (3, True, 'abc', 1)
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


class Disk:
    """The space left under ``root``: ``None`` is as much as the real disk has, a number is what the next writes
    get (each write takes its bytes from it)."""

    def __init__(self, root: str | Path, free: int | None = None):
        self.root = Path(root).resolve()
        self.free = free
        self.only: str | None = None
        """The files the shortage hits, by a part of their name (None: every file under ``root``)."""
        self.refused = 0
        """Writes that raised ``ENOSPC``."""
        self.fills = 0
        """Times the disk was filled (:meth:`fill`)."""

    def fill(self) -> None:
        """No byte free from now on."""
        self.free = 0
        self.fills += 1

    def room(self, free: int | None = None) -> None:
        """``free`` bytes free from now on (None: the real disk's space)."""
        self.free, self.only = free, None

    def cut(self, name: str, after: int) -> None:
        """The next writes to files whose name holds ``name`` (its temporary copy too) get ``after`` bytes in all, then
        ``ENOSPC`` (a line cut part-way); every other file has room."""
        self.free, self.only = after, name

    def _ours(self, path: str | Path) -> bool:
        try:
            return Path(path).resolve().is_relative_to(self.root)
        except (OSError, ValueError):
            return False

    @contextlib.contextmanager
    def mounted(self) -> Iterator[Disk]:
        """Route ``os.write`` and ``shutil.disk_usage`` through this disk while the block runs."""
        write, usage = os.write, shutil.disk_usage

        def shim_write(fd: int, data: bytes | memoryview) -> int:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if self.free is None or not self._ours(target) or (self.only and self.only not in Path(target).name):
                return write(fd, data)
            fits = min(len(data), self.free)
            if fits == 0 and len(data):
                self.refused += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.free -= fits
            return write(fd, bytes(data[:fits]))

        def shim_usage(path: str | Path) -> shutil._ntuple_diskusage:  # type: ignore[name-defined]
            real = usage(path)
            if self.free is None or not self._ours(path):
                return real
            return type(real)(real.total, real.total - self.free, self.free)

        os.write, shutil.disk_usage = shim_write, shim_usage
        try:
            yield self
        finally:
            os.write, shutil.disk_usage = write, usage
