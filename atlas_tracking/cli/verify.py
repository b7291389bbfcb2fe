"""``atlas-tracking verify``: recompute every value of a receipts artifact from its per-window arrays."""

from __future__ import annotations

import argparse
import sys

from atlas_tracking.artifacts.gate_report import read_artifact, verify


def run(args: argparse.Namespace) -> int:
    data = read_artifact(args.receipts)
    problems = verify(data)
    for p in problems:
        print(f"MISMATCH {p}")
    if problems:
        print(f"{args.receipts}: {len(problems)} disagreement(s)", file=sys.stderr)
        return 1
    n = len(data["layers"])
    print(f"{args.receipts}: OK, every receipt, CI, pass/fail and summary recomputed from per-window arrays ({n} layers)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="recompute every pass/fail and summary of a receipts JSON")
    p.add_argument("receipts")
    p.set_defaults(func=run)
