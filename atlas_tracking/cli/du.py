"""``atlas-tracking du``: what a run's record holds and what it costs on disk, and the retention in force."""

from __future__ import annotations

import argparse
import json
from typing import Any

from atlas_tracking.artifacts.disk_usage import disk_usage
from atlas_tracking.artifacts.missing_reference import missing_lines, missing_references


def format_usage(usage: dict[str, Any]) -> str:
    """The text ``atlas-tracking du`` prints for :func:`~atlas_tracking.artifacts.disk_usage.disk_usage`.

    >>> usage = {"run_dir": "atlas", "total": 300, "bytes": {"baselines": 200, "receipts": 100},
    ...          "baselines": [{"name": "step_00000010.a", "step": 10, "bytes": 200, "roles": ["current"]}],
    ...          "receipts_files": 1, "gates": 2, "bytes_per_gate": {"mean": 150.0, "last": 250},
    ...          "retention": {"keep_baselines": 2, "keep_receipts": None, "pinned": []}}
    >>> print(format_usage(usage))
    atlas: 300 bytes, 2 gate(s), 150 bytes per gate (mean), 250 bytes the last gate
      baselines         200
        step_00000010.a  step 10  200  current
      receipts          100  (1 file(s))
    retention: gate.keep_baselines 2, gate.keep_receipts all, pinned steps none
    """
    per_gate = usage["bytes_per_gate"]
    mean = "-" if per_gate["mean"] is None else f"{per_gate['mean']:.0f}"
    lines = [f"{usage['run_dir']}: {usage['total']} bytes, {usage['gates']} gate(s), {mean} bytes per gate (mean), "
             f"{per_gate['last']} bytes the last gate"]
    for kind, size in usage["bytes"].items():
        extra = f"  ({usage['receipts_files']} file(s))" if kind == "receipts" else ""
        lines.append(f"  {kind:<16}{size:>5}{extra}")
        if kind == "baselines":
            lines += [f"    {b['name']}  step {b['step']}  {b['bytes']}  {', '.join(b['roles'])}".rstrip()
                      for b in usage["baselines"]]
    ret = usage["retention"]
    keep = "all" if ret["keep_receipts"] is None else ret["keep_receipts"]
    pinned = ", ".join(str(s) for s in ret["pinned"]) or "none"
    note = "" if ret.get("recorded", True) else " (no gate recorded it: the defaults)"
    lines.append(f"retention: gate.keep_baselines {ret['keep_baselines']}, gate.keep_receipts {keep}, "
                 f"pinned steps {pinned}{note}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    usage = {**disk_usage(args.run), "missing_references": missing_references(args.run)}
    print(json.dumps(usage, allow_nan=False) if args.json else "\n".join(
        [format_usage(usage), *missing_lines(usage["missing_references"])]))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("du", help="bytes a run's record holds per kind (baselines, receipts, JSON lines), per gate, "
                                  "and the retention in force")
    p.add_argument("run", help="the run's atlas directory, a Lightning root or its gates.jsonl")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
