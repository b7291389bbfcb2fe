"""The collectives of a gate, bounded: a process that stops or exits is named, never waited for in silence.

A gate's collectives run on the training's process group, whose own timeout is long (30 minutes under gloo by
default, and a stopped process is waited for that long without a word). Inside :func:`bounded` every
:func:`checkpoint` first meets the other processes at a ``torch.distributed.monitored_barrier`` on a side gloo
group (created once per process group, on the first checkpoint, with ``gate.collective_timeout_s`` as its
timeout). Rank zero waits there for every other process and names those that do not arrive in time; the others
wait for rank zero's answer. A process that had already exited, which gloo does not name, is named by the count of
checkpoints each process writes to the process group's store on arrival. A process that does not arrive (stopped,
exited, or stuck elsewhere) fails the gate on every process that can still speak with :class:`RanksUnresponsive`,
naming the processes and the step; the gate's failure path records it (``errors.jsonl``, the alert, every tracker).
The side group does not survive a failed barrier, so later checkpoints of the same process group raise at once,
naming the same processes.

Outside :func:`bounded`, in a single process, with one process in the group, or in a torch built without gloo, a
checkpoint does nothing. Collectives the model makes inside its own forward (an expert-parallel exchange, a sharded
parameter's gather) are the model's: the framework's process group bounds those
(docs/distributed.md#a-stalled-or-dead-rank).

Example (one process: nothing to wait for):
    >>> with bounded(5.0, step=10):
    ...     checkpoint("the record")
    ...     from_rank_zero({"dir": "atlas"})
    {'dir': 'atlas'}
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import functools
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

log = logging.getLogger("atlas_tracking")

DOC = "docs/distributed.md#a-stalled-or-dead-rank"


class RanksUnresponsive(RuntimeError):
    """Processes of a gate did not reach one of its collectives within ``gate.collective_timeout_s``."""

    def __init__(self, message: str, ranks: list[int] | None, step: int):
        super().__init__(message)
        self.ranks = ranks
        """The processes rank zero named (None where this process could not tell: it waited for rank zero)."""
        self.step = step


@dataclass
class _Bound:
    timeout_s: float
    step: int


@dataclass
class _Side:
    world: Any
    """The process group this side group belongs to (a new ``init_process_group`` gets a new side group)."""
    group: Any
    timeout_s: float
    failed: RanksUnresponsive | None = None
    count: int = 0
    """Checkpoints this process has reached (the same sequence on every process: checkpoints are collective)."""


_BOUND: contextvars.ContextVar[_Bound | None] = contextvars.ContextVar("atlas_collective_bound", default=None)
_SIDE: list[_Side] = []


def _world_size() -> int:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    return torch.distributed.get_world_size()


@contextlib.contextmanager
def bounded(timeout_s: float, step: int) -> Iterator[None]:
    """Every :func:`checkpoint` inside waits at most ``timeout_s`` seconds for the other processes; ``step``
    names the gate in the error."""
    token = _BOUND.set(_Bound(float(timeout_s), int(step)))
    try:
        yield
    finally:
        _BOUND.reset(token)


F = TypeVar("F", bound=Callable[..., Any])


def bounded_gate(method: F) -> F:
    """A gate's method ``method(self, step, ...)`` runs :func:`bounded` by ``self.config.gate.collective_timeout_s``
    at ``step``."""

    @functools.wraps(method)
    def run(self: Any, step: int, *args: Any, **kwargs: Any) -> Any:
        with bounded(self.config.gate.collective_timeout_s, step):
            return method(self, step, *args, **kwargs)

    return run  # type: ignore[return-value]


def _side(timeout_s: float) -> _Side:
    world = torch.distributed.group.WORLD
    if _SIDE and _SIDE[0].world is world and _SIDE[0].timeout_s == timeout_s:
        return _SIDE[0]
    timeout = datetime.timedelta(seconds=timeout_s)
    _SIDE[:] = [_Side(world, torch.distributed.new_group(backend="gloo", timeout=timeout), timeout_s)]
    return _SIDE[0]


def _named(error: str) -> list[int] | None:
    found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", error)
    return [int(r) for r in found.group(1).split(",") if r.strip()] if found else None


def _key(rank: int) -> str:
    return f"atlas_collectives/reached/{rank}"


def _behind(side: _Side) -> list[int] | None:
    """The processes that had not reached this checkpoint, from the count each wrote to the process group's store
    on arrival: the names gloo does not give when a process had already exited (its connection is closed before
    the barrier starts). None when the store cannot be read."""
    try:
        store = torch.distributed.distributed_c10d._get_default_store()
        return [r for r in range(1, torch.distributed.get_world_size())
                if not store.check([_key(r)]) or int(store.get(_key(r))) < side.count]
    except Exception:  # the store lives with the process group's launcher: it may be gone too
        return None


def checkpoint(what: str) -> None:
    """Before the collective ``what`` of a gate: every process meets at a monitored barrier first (inside
    :func:`bounded`, under ``torch.distributed`` with more than one process); raises :class:`RanksUnresponsive`
    when one does not arrive in time."""
    bound = _BOUND.get()
    if bound is None or _world_size() == 1 or not torch.distributed.is_gloo_available():
        return
    rank = torch.distributed.get_rank()
    try:
        side = _side(bound.timeout_s)
    except Exception as exc:  # the side group is made collectively: a process that never came leaves it unmade
        raise _unresponsive(None, rank, bound, what, f"{type(exc).__name__}: {exc}") from exc
    if side.failed is not None:
        raise RanksUnresponsive(f"{side.failed} (earlier); the gate's collectives are not attempted again in this "
                                f"process group ({what} at step {bound.step})", side.failed.ranks, bound.step)
    side.count += 1
    try:
        torch.distributed.distributed_c10d._get_default_store().set(_key(rank), str(side.count))
        torch.distributed.monitored_barrier(group=side.group, timeout=datetime.timedelta(seconds=bound.timeout_s),
                                            wait_all_ranks=True)
    except RuntimeError as exc:
        ranks = (_named(str(exc)) or _behind(side)) if rank == 0 else None
        side.failed = _unresponsive(ranks, rank, bound, what, str(exc))
        raise side.failed from exc


def _unresponsive(ranks: list[int] | None, rank: int, bound: _Bound, what: str, error: str) -> RanksUnresponsive:
    """The error naming who did not answer, logged on this process (rank zero's also reaches the gate's record)."""
    limit = f"within gate.collective_timeout_s = {bound.timeout_s:g} s"
    if ranks:
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        message = (f"{who} did not reach the gate's collective ({what}) at step {bound.step} {limit}: stopped, "
                   f"exited or stuck elsewhere ({DOC})")
    elif rank != 0:
        message = (f"rank {rank} had no answer from rank 0 at the gate's collective ({what}) at step {bound.step} "
                   f"{limit}: rank 0 or another rank stopped, exited or is stuck elsewhere; rank 0's error names "
                   f"it ({DOC}; {error.splitlines()[0]})")
    else:
        message = (f"the processes did not all reach the gate's collective ({what}) at step {bound.step} {limit} "
                   f"({DOC}; {error.splitlines()[0]})")
    if rank != 0:
        log.error("atlas: %s", message)  # rank zero's failure path writes the record and logs it there
    return RanksUnresponsive(message, ranks, bound.step)


def from_rank_zero(obj: Any) -> Any:
    """Rank zero's ``obj`` on every rank (collective under ``torch.distributed``; a :func:`checkpoint` first)."""
    if _world_size() == 1:
        return obj
    checkpoint("rank zero's decision")
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
