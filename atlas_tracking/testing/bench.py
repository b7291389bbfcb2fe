"""What the CPU benchmarks in ``benchmarks/`` share: interleaved passes timed in CPU seconds, a process's host peak,
and their JSON.

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
    >>> start = reset_host_peak()   # Linux: None elsewhere
    >>> start is None or host_rss("VmHWM") >= start
    True
    >>> import contextlib, io, json
    >>> out = Path(tempfile.mkdtemp()) / "r.json"
    >>> with contextlib.redirect_stdout(io.StringIO()) as printed:
    ...     write_result({"ratio": 1.5}, out)
    >>> result = json.loads(out.read_text())
    >>> result["ratio"], sorted(result["host"]), printed.getvalue() == out.read_text()
    (1.5, ['cores', 'cpu', 'vector_units'], True)
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from io import BytesIO
from pathlib import Path
from types import ModuleType
from typing import Any

import torch


def _interleaved(passes: dict[str, Callable[[], Any]], repeats: int, read: Callable[[], Any],
                 spent: Callable[[Any, Any], Any]) -> dict[str, list[Any]]:
    """``spent(before, after)`` of ``read()`` around each pass, ``repeats`` times, the passes interleaved."""
    out: dict[str, list[Any]] = {name: [] for name in passes}
    for _ in range(repeats):
        for name, run in passes.items():
            before = read()
            run()
            out[name].append(spent(before, read()))
    return out


def seconds(passes: dict[str, Callable[[], Any]], repeats: int,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds of each pass on ``clock`` (default wall time), ``repeats`` times, the passes interleaved."""
    return _interleaved(passes, repeats, clock, lambda t0, t1: t1 - t0)


def cpu_seconds(passes: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """CPU seconds of each pass, ``repeats`` times, the passes interleaved."""
    return seconds(passes, repeats, time.process_time)


def cpu_usage(passes: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[dict[str, float]]]:
    """Each pass's CPU time split as the kernel accounts it, ``repeats`` times, the passes interleaved: ``user`` and
    ``system`` seconds of the process and its minor page ``faults`` (memory the allocator took back from the system
    and touched again; Linux and macOS, ``resource.getrusage``).

    >>> usage = cpu_usage({"a": lambda: bytearray(1 << 20)}, repeats=2)
    >>> sorted(usage["a"][0]), len(usage["a"])
    (['faults', 'system', 'user'], 2)
    """
    import resource

    def now() -> tuple[float, float, int]:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime, r.ru_stime, r.ru_minflt

    return _interleaved(passes, repeats, now, lambda before, after: dict(
        zip(("user", "system", "faults"), (b - a for a, b in zip(before, after)))))


def gate_bench_inputs(width: int, layers: int = 24, experts: int = 128, top_k: int = 8,
                      windows: int = 32) -> tuple[torch.nn.Module, Any]:
    """The model and canary the gate-cost benchmarks measure: a freshly initialised Qwen3-MoE (seed 0, ``layers``
    routed layers x ``experts``, top-``top_k``, ``width`` wide, no load-balancing loss) in eval mode, and a
    ``windows`` x 128-token canary of the demo text. The package is imported here, when called: a benchmark that loads
    this module by its path (``gate_fresh_processes.py``) builds them with the package on its process's path."""
    from atlas_tracking import Canary
    from atlas_tracking.testing.demo import demo_canary
    from atlas_tracking.testing.lightning_lm import build_qwen3_moe

    model = build_qwen3_moe(seed=0, hidden=width, layers=layers, experts=experts, top_k=top_k, aux_coef=0.0).eval()
    return model, Canary.from_token_ids(demo_canary().windows.reshape(-1), window=128, n_windows=windows, seed=0)


VECTOR_UNITS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
"""The CPU flags that decide how fast a float32 matrix product runs, named in a benchmark's host."""


def host_description() -> dict[str, Any]:
    """The CPU a benchmark ran on: its model name and which of :data:`VECTOR_UNITS` it has (Linux's
    ``/proc/cpuinfo``; the machine type elsewhere), and the cores this process may use. Ratios to the plain forward
    differ between hosts: a host whose matrix products are slower gives the gate's other work a smaller share."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]  # the first processor's entry
        info = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first.splitlines())}
        cpu, flags = info.get("model name", cpu), set(info.get("flags", "").split())
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "vector_units": [unit for unit in VECTOR_UNITS if unit in flags], "cores": cores}


def write_result(result: dict[str, Any], out: str | Path) -> None:
    """Write a benchmark's result as JSON to ``out`` and print it, with the host it ran on
    (:func:`host_description`) as ``host`` where the result does not name one: a ratio read on one CPU is not
    another's."""
    text = json.dumps({**result, "host": result.get("host") or host_description()}, indent=1)
    Path(out).write_text(text + "\n")
    print(text)


def host_rss(key: str) -> int | None:
    """A line of ``/proc/self/status`` in bytes: ``VmRSS`` (resident now) or ``VmHWM`` (the peak since the last
    :func:`reset_host_peak`); None where there is no such file (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
    except (OSError, StopIteration):
        return None


def reset_host_peak() -> int | None:
    """Reset the process's host peak (``VmHWM``) to its resident size now and return that size (Linux; None
    elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return host_rss("VmRSS")


def plain_forward(model: torch.nn.Module, canary: Any, batch: int) -> None:
    """The model's own no-grad forward over a canary's windows (``canary.windows``, ``[W, L]`` token ids), ``batch``
    windows per call, on the model's device: what a gate's cost is measured against."""
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(canary.windows), batch):
            ids = torch.as_tensor(canary.windows[start : start + batch], dtype=torch.long, device=device)
            model(input_ids=ids, use_cache=False)


def package_tree_at(commit: str, into: Path, repo: Path) -> Path:
    """The package ``atlas_tracking`` as it was at ``commit`` of the git checkout ``repo``, extracted under ``into``
    (``into / "atlas_tracking"``): what a benchmark of an earlier commit imports or puts on a process's path."""
    archive = subprocess.run(["git", "archive", commit, "atlas_tracking"], cwd=repo, check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def renamed_package_at(commit: str, into: Path, repo: Path) -> Path:
    """The package at ``commit`` of ``repo`` renamed ``atlas_tracking_<commit>``, its own imports with it, under
    ``into``; returns its folder, which :func:`import_renamed` imports beside this tree's package (also on a machine
    that has the folder and not the git history)."""
    return rename_package(package_tree_at(commit, into, repo) / "atlas_tracking", f"atlas_tracking_{commit}")


def rename_package(package: Path, name: str) -> Path:
    """The package folder ``package`` (a copy of ``atlas_tracking``) renamed ``name`` beside where it is, its own
    imports with it; returns the new folder."""
    tree = package.rename(package.parent / name)
    for path in tree.rglob("*.py"):
        path.write_text(path.read_text().replace("atlas_tracking", name))
    return tree


def import_renamed(tree: Path) -> ModuleType:
    """The renamed package in the folder ``tree`` (:func:`renamed_package_at`), imported under its folder's name."""
    name = tree.name
    spec = importlib.util.spec_from_file_location(name, tree / "__init__.py", submodule_search_locations=[str(tree)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its own imports of name.* resolve from here
    spec.loader.exec_module(module)
    return module
