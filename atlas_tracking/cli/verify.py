"""``atlas-tracking verify``: recompute every value of a receipts artifact from its per-window arrays."""

from __future__ import annotations

import argparse
import sys

from atlas_tracking.artifacts.gate_report import read_artifact, verify
from atlas_tracking.artifacts.receipts_file import form_of


def run(args: argparse.Namespace) -> int:
    data = read_artifact(args.receipts)
    problems = verify(data)
    for p in problems:
        print(f"MISMATCH {p}")
    if problems:
        print(f"{args.receipts}: {len(problems)} disagreement(s)", file=sys.stderr)
        return 1
    n, form = len(data["layers"]), form_of(args.receipts)
    print(f"{args.receipts}: OK, every receipt, CI, pass/fail and summary recomputed from per-window arrays ({n} layers, "
          f"{form} form)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="recompute every pass/fail and summary of a receipts artifact")
    p.add_argument("receipts", help="receipts artifact (.json or .safetensors)")
    p.set_defaults(func=run)
