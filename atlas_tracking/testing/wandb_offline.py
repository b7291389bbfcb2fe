"""Reading an offline W&B run back without a server, with wandb's own protobuf records."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(path: Path):
    """Record payloads of a ``.wandb`` file (a LevelDB-style log of 32 KiB blocks after a 7-byte header)."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file (bad magic)")
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0 and length == 0:
            pos += left
            continue
        body = data[pos + _HEADER : pos + _HEADER + length]
        if len(body) < length:
            return  # a torn tail (the run is still being written)
        if zlib.crc32(body, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path} is corrupted: record checksum mismatch at byte {pos}")
        pos += _HEADER + length
        if kind == _FULL:
            yield body
        elif kind == _FIRST:
            pending = body
        elif kind == _MIDDLE:
            pending += body
        elif kind == _LAST:
            yield pending + body
            pending = b""


def _put(target: dict[str, Any], item: Any, value: Any) -> None:
    """Store a history/summary item; nested keys (e.g. a table's fields) become nested dicts."""
    keys = [item.key] if item.key else list(item.nested_key)
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = value


def read_wandb_offline(run_dir: str | Path) -> dict[str, Any]:
    """History rows, summary and alerts of an offline run, decoded with wandb's protobuf ``Record``.

    ``run_dir`` is the ``offline-run-*`` directory (or the ``.wandb`` file itself). ``complete`` says
    whether the run's exit record is in the file (a run still being written has a partial history).
    """
    from wandb.proto import wandb_internal_pb2

    path = Path(run_dir)
    if path.is_dir():
        files = sorted(path.glob("*.wandb"))
        if not files:
            raise FileNotFoundError(f"no .wandb file in {path}")
        path = files[0]
    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    alerts: list[dict[str, Any]] = []
    complete = False
    for payload in _payloads(path):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row: dict[str, Any] = {}
            for item in rec.history.item:
                _put(row, item, json.loads(item.value_json))
            if rec.history.HasField("step"):
                row.setdefault("_step", rec.history.step.num)
            history.append(row)
        elif kind == "summary":
            for item in rec.summary.update:
                _put(summary, item, json.loads(item.value_json))
        elif kind == "alert":
            alerts.append({"title": rec.alert.title, "text": rec.alert.text, "level": rec.alert.level,
                           "wait_duration": rec.alert.wait_duration})
        elif kind == "exit":
            complete = True
    return {"history": history, "summary": summary, "alerts": alerts, "file": str(path), "complete": complete}


def wait_for_offline_run(run_dir: str | Path, timeout_s: float = 60.0) -> dict[str, Any]:
    """Read an offline run once its exit record is on disk (W&B flushes the file after ``finish``)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        data = read_wandb_offline(run_dir)
        if data["complete"] or time.monotonic() > deadline:
            return data
        time.sleep(0.2)
