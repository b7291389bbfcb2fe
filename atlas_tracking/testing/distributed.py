"""Gloo worker processes for the multi-process tests: spawned with torch.multiprocessing, one thread each.

``run_workers(fn, world, *args)`` starts ``world`` processes in a fresh gloo group on 127.0.0.1 (one torch
thread each unless ``threads`` says otherwise; None keeps torch's default), calls ``fn(rank, world, *args)``
in each, and returns their JSON-able results in rank order (None for a rank in ``lost``, one that may leave
without a result: a test's process that exits on purpose). A worker that raises
fails the caller with its traceback; workers still running after ``timeout`` seconds (a collective mismatch
hangs) are killed and the caller gets a ``TimeoutError``.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_rank_env(env: Any) -> None:
    """Set a one-process group's launcher variables (a free port on 127.0.0.1) through ``env``, a
    ``pytest.MonkeyPatch``, so they are restored when it is undone."""
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                           LOCAL_RANK="0").items():
        env.setenv(key, value)


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, out: str, args: tuple,
           threads: int | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if threads is not None:
        torch.set_num_threads(threads)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    finally:
        # free what ``fn`` left in reference cycles (a Trainer holding its DDP wrapper, the wrapper its reducer and
        # the group's pending work) while the interpreter is whole: gloo work freed during interpreter finalization
        # takes the GIL of a dying interpreter and aborts the process ("terminate called without an active exception")
        gc.collect()
        torch.distributed.destroy_process_group()
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is written; skip the finalization of third-party C++ objects, whose order is not ours


def run_workers(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0,
                threads: int | None = 1, lost: tuple[int, ...] = ()) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo processes; their results in rank order."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_entry, args=(fn, world, free_port(), out, args, threads), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{world} worker processes of {fn.__name__} still running after {timeout:.0f} s")
        return [None if r in lost and not Path(out, f"{r}.json").exists() else
                json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]
