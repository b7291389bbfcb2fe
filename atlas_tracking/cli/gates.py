"""``atlas-tracking gates``: a run's gate table, the training-batch load between its gates, its failed gates and what
each tracker still lacks."""

from __future__ import annotations

import argparse
import json

from atlas_tracking.artifacts.missing_reference import missing_lines, missing_references
from atlas_tracking.viz.gate_table import format_run_gates, run_gates


def run(args: argparse.Namespace) -> int:
    summary = {**run_gates(args.run), "missing_references": missing_references(args.run)}
    print(json.dumps(summary, allow_nan=False) if args.json else "\n".join(
        [format_run_gates(summary), *missing_lines(summary["missing_references"])]))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gates", help="print a run's gates (step, phase, status, stage, key receipts), the "
                                     "training-batch load between them (load.jsonl: the last interval, alarms, "
                                     "early gates), the failed gates and the gates not yet delivered to each tracker")
    p.add_argument("run", help="the run's atlas directory, a Lightning root or its gates.jsonl")
    p.add_argument("--json", action="store_true", help="print one JSON object (header, rows, load, failed, backlog)")
    p.set_defaults(func=run)
