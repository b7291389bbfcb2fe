"""What the CPU benchmarks in ``benchmarks/`` share: interleaved passes timed in CPU seconds, and their JSON.

Times are CPU seconds of the process (``time.process_time``): on a machine shared with other work, wall time
carries their load. Passes run round-robin, so drift in the machine's state hits every pass alike.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> times = cpu_seconds({"a": lambda: sum(range(1000)), "b": lambda: None}, repeats=3)
    >>> sorted(times), [len(t) for t in times.values()]
    (['a', 'b'], [3, 3])
    >>> [len(t) for t in seconds({"a": lambda: None}, repeats=2).values()]   # wall time
    [2]
    >>> out = Path(tempfile.mkdtemp()) / "r.json"
    >>> write_result({"ratio": 1.5}, out)
    {
     "ratio": 1.5
    }
    >>> out.read_text()
    '{\\n "ratio": 1.5\\n}\\n'
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def seconds(passes: dict[str, Callable[[], Any]], repeats: int,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds of each pass on ``clock`` (default wall time), ``repeats`` times, the passes interleaved."""
    times: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(repeats):
        for name, run in passes.items():
            t0 = clock()
            run()
            times[name].append(clock() - t0)
    return times


def cpu_seconds(passes: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """CPU seconds of each pass, ``repeats`` times, the passes interleaved."""
    return seconds(passes, repeats, time.process_time)


def write_result(result: dict[str, Any], out: str | Path) -> None:
    """Write a benchmark's result as JSON to ``out`` and print it."""
    text = json.dumps(result, indent=1)
    Path(out).write_text(text + "\n")
    print(text)
