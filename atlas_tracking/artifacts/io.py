"""Writing and reading artifacts: atomic file writes, JSON-ready values, headers and checksums."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import math
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from atlas_tracking.schema.record import version_refused


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


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write every byte of ``data`` to the open file descriptor ``fd`` (``os.write`` may write fewer)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def free_bytes(path: str | Path) -> int | None:
    """The bytes free on the file system that holds ``path`` (its nearest existing folder), or None when unknown."""
    path = Path(path)
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def named_error(exc: OSError, path: str | Path) -> OSError:
    """``exc`` as an ``OSError`` that names the file it failed on and, on a full disk, the free space there.

    >>> str(named_error(OSError(errno.EACCES, "Permission denied"), "atlas/gates.jsonl"))
    "[Errno 13] Permission denied: 'atlas/gates.jsonl'"
    """
    if exc.filename is not None and exc.errno != errno.ENOSPC:
        return exc
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT) and "free" not in reason:
        free = free_bytes(path)
        reason += f" ({'unknown' if free is None else free} bytes free there)"
    named = OSError(exc.errno, reason, str(path))
    named.__cause__ = exc
    return named


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable (a rename into it survives a crash); best effort,
    since some file systems cannot open or fsync a directory."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_durably(src: Path, dst: Path) -> Path:
    """Rename ``src`` (a file or a directory whose contents are already on disk) to ``dst``, then fsync the
    directories that hold the two names, so that after a crash the rename is either complete or not done.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / "a").write_text("x")
    >>> replace_durably(d / "a", d / "b").read_text(), (d / "a").exists()
    ('x', False)
    """
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)
    if Path(src).parent != Path(dst).parent:
        fsync_dir(Path(src).parent)
    return Path(dst)


def write_atomic(path: Path, data: str | bytes | Iterable[bytes | memoryview]) -> Path:
    """Replace ``path`` with ``data`` atomically and durably: a temporary file beside it, written and
    fsynced, renamed into place, then the directory fsynced. A crash leaves the old file or the new one,
    never a torn one. ``data`` may be given as chunks, written in turn (a large file is then never in memory
    whole).

    >>> import tempfile
    >>> target = Path(tempfile.mkdtemp()) / "sub" / "out.json"
    >>> write_atomic(target, "{}").read_text(), sorted(p.name for p in target.parent.iterdir())
    ('{}', ['out.json'])
    >>> write_atomic(target, iter([b"[1,", memoryview(b"2]")])).read_text()
    '[1,2]'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    chunks = [data.encode() if isinstance(data, str) else data] if isinstance(data, (str, bytes)) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        try:
            for chunk in chunks:
                write_all(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # nothing half-written is left beside the file
        if isinstance(exc, OSError):
            raise named_error(exc, path) from exc
        raise
    return replace_durably(tmp, path)


def check_header(data: Any, kind: str, max_version: int, where: str, error: type[ValueError]) -> None:
    """An artifact's ``kind`` and ``schema_version`` (a newer schema than this code reads is an error)."""
    if not isinstance(data, dict) or data.get("kind") != kind:
        raise error(f"{where} is not an {kind} artifact (missing kind={kind!r})")
    if (refused := version_refused(data.get("schema_version"), max_version)) is not None:
        raise error(f"{where} {refused}")


def sha256_text(text: str | bytes) -> str:
    """The sha256 of a text's UTF-8 bytes, or of bytes (what a file holding them hashes to).

    >>> sha256_text("{}") == sha256_text(b"{}")
    True
    """
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()
