"""``atlas-tracking verify``: recompute every value of a receipts artifact from its per-window arrays."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from atlas_tracking.artifacts.gate_report import read_artifact, verify
from atlas_tracking.artifacts.missing_reference import missing_lines, missing_references
from atlas_tracking.artifacts.receipts_file import form_of
from atlas_tracking.schema.artifacts import GATES


def run(args: argparse.Namespace) -> int:
    data = read_artifact(args.receipts)
    problems = verify(data)
    for p in problems:
        print(f"MISMATCH {p}")
    missing = _missing_reference(Path(args.receipts))
    for line in missing_lines(missing):
        print(line)
    problems = [*problems, *missing]
    if problems:
        print(f"{args.receipts}: {len(problems)} disagreement(s)", file=sys.stderr)
        return 1
    n, form = len(data["layers"]), form_of(args.receipts)
    print(f"{args.receipts}: OK, every receipt, CI, pass/fail and summary recomputed from per-window arrays ({n} layers, "
          f"{form} form)")
    return 0


def _missing_reference(receipts: Path) -> list[dict[str, Any]]:
    """A receipts file of a run directory (``receipts/step_N``): its gate, when the reference it names is missing."""
    run = receipts.parent.parent
    if receipts.parent.name != "receipts" or not (run / GATES).is_file():
        return []
    return [m for m in missing_references(run) if receipts.name.startswith(f"step_{m['step']:08d}.")]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="recompute every pass/fail and summary of a receipts artifact")
    p.add_argument("receipts", help="receipts artifact (.json or .safetensors)")
    p.set_defaults(func=run)
