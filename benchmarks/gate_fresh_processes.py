"""A gate's cost over the plain forward at two commits, each measured in fresh processes, the processes alternating.

``python benchmarks/gate_fresh_processes.py --before 83fd509 --width 256`` writes
``benchmarks/gate_fresh_processes_w256.json``: for a freshly initialised Qwen3-MoE (24 routed layers x 128 experts,
k = 8, float32, ``--width`` wide) over a 32 x 128-token canary in micro-batches of 8 windows, ``--processes`` fresh
processes of the package at the earlier commit and as many of this tree's, alternating; each builds the model, warms
up, then times a plain no-grad forward and a gate (no baseline, ``--kernels`` field arithmetic) interleaved
``--repeats`` times (CPU seconds, one torch thread) and reports the median of each repeat's gate / forward ratio, of
CPU seconds (``paired``, user and system) and of user seconds alone (``paired_user``), with each pass's median
system seconds and minor page faults: a host whose allocator returns freed memory to the system makes whichever
pass finds it gone fault it back, in system time. The result names the host's CPU (``host``): the ratio differs
between hosts. A commit from before ``receipts.kernels`` is measured as it computed, eagerly.

Why fresh processes: one process holding both commits' gates (``gate_before_after.py``) leaves each gate the other's
freed memory, and on a host whose allocator returns freed memory to the system the gates' large temporaries then
cost more than in a process of their own (``benchmarks/RESULTS.md`` (u)); here every gate runs as an operator's
would, alone with its model. Results in ``benchmarks/RESULTS.md`` (u), with user seconds and page faults in (v).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
LAYERS, EXPERTS, TOP_K, WINDOWS, BATCH = 24, 128, 8, 32, 8


def instrument() -> ModuleType:
    """This tree's ``atlas_tracking/testing/bench.py`` loaded as a module of its own (it imports only torch): every
    child times the package of its commit with the same instrument, whatever that commit's own copy holds."""
    spec = importlib.util.spec_from_file_location("gate_fresh_processes_bench",
                                                  HERE.parent / "atlas_tracking" / "testing" / "bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child(width: int, repeats: int, kernels: str) -> dict[str, Any]:
    """One process's measurement: the package on this process's path, its model, warm-up, interleaved passes."""
    import torch

    import atlas_tracking
    from atlas_tracking import AtlasConfig, measure
    from atlas_tracking.schema.config import ReceiptsConfig

    torch.set_num_threads(1)
    bench = instrument()
    model, canary = bench.gate_bench_inputs(width, LAYERS, EXPERTS, TOP_K, WINDOWS)
    receipts = {"progress": False, "batch_windows": BATCH}
    if "kernels" in {f.name for f in dataclasses.fields(ReceiptsConfig)}:
        receipts["kernels"] = kernels
    elif kernels != "eager":  # a commit before receipts.kernels computed eagerly
        raise ValueError(f"the package at {atlas_tracking.__file__} has no receipts.kernels to set to {kernels}")
    cfg = AtlasConfig.from_dict({"receipts": receipts})
    passes = {"plain": lambda: bench.plain_forward(model, canary, BATCH),
              "gate": lambda: measure(model, canary, config=cfg, keep_anchors=False)}
    for run in passes.values():  # the warm-up (and a compile)
        run()
    usage = bench.cpu_usage(passes, repeats)
    times = {name: [u["user"] + u["system"] for u in us] for name, us in usage.items()}
    ratios = [g / p for g, p in zip(times["gate"], times["plain"])]
    user = [g["user"] / p["user"] for g, p in zip(usage["gate"], usage["plain"])]
    return {"package": str(Path(atlas_tracking.__file__).parent), "plain_s": statistics.median(times["plain"]),
            "gate_s": statistics.median(times["gate"]), "paired": statistics.median(ratios),
            "paired_spread": [min(ratios), max(ratios)], "paired_user": statistics.median(user),
            **{f"{name}_{part}": statistics.median(u[part] for u in usage[name])
               for name in passes for part in ("system", "faults")}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="the earlier commit")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--kernels", default="eager", choices=["eager", "compiled"])
    ap.add_argument("--processes", type=int, default=4, help="fresh processes per commit")
    ap.add_argument("--repeats", type=int, default=4, help="interleaved passes per process")
    ap.add_argument("--out", default=None, help="default benchmarks/gate_fresh_processes_w{width}.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.width, args.repeats, args.kernels)))
        return 0
    if args.before is None:
        ap.error("--before is required")
    from atlas_tracking.testing.bench import (  # here, not in a child: it imports an earlier package
        package_tree_at,
        write_result,
    )

    roots = {"before": package_tree_at(args.before, Path(tempfile.mkdtemp()), HERE.parent), "after": HERE.parent}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in roots}
    for _ in range(args.processes):
        for name, root in roots.items():
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
            out = subprocess.run([sys.executable, __file__, "--child", "--width", str(args.width), "--repeats",
                                  str(args.repeats), "--kernels", args.kernels], env=env, check=True,
                                 capture_output=True, text=True).stdout
            run = json.loads(out.strip().splitlines()[-1])
            if not Path(run["package"]).is_relative_to(root):
                raise RuntimeError(f"the {name} process imported {run['package']}, not the package under {root}")
            runs[name].append(run)
    result = {
        "before": args.before, "width": args.width, "layers": LAYERS, "experts": EXPERTS, "top_k": TOP_K,
        "canary_windows": WINDOWS, "batch_windows": BATCH, "kernels": args.kernels, "torch_threads": 1,
        "processes": args.processes, "repeats": args.repeats,
        "gate_over_plain": {name: statistics.median(r["paired"] for r in rs) for name, rs in runs.items()},
        "gate_over_plain_spread": {name: [min(r["paired"] for r in rs), max(r["paired"] for r in rs)]
                                   for name, rs in runs.items()},
        "gate_over_plain_user": {name: statistics.median(r["paired_user"] for r in rs) for name, rs in runs.items()},
        "runs": runs,
    }
    write_result(result, args.out or HERE / f"gate_fresh_processes_w{args.width}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
