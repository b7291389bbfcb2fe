"""``atlas-tracking report``: a self-contained HTML page for a run or one receipts file."""

from __future__ import annotations

import argparse
from pathlib import Path

from atlas_tracking.artifacts.missing_reference import missing_lines, missing_references
from atlas_tracking.artifacts.receipts_file import FORMS
from atlas_tracking.viz.html_report import write_report


def run(args: argparse.Namespace) -> int:
    path = write_report(args.source, args.out, args.png_dir)
    print(f"wrote {path}")
    if Path(args.source).suffix not in FORMS:
        for line in missing_lines(missing_references(args.source)):
            print(line)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="self-contained HTML report of a run directory or a receipts artifact")
    p.add_argument("source", help="run directory (with atlas/gates.jsonl) or a receipts artifact "
                   "(.json or .safetensors)")
    p.add_argument("--out", required=True, help="HTML file to write")
    p.add_argument("--png-dir", help="also write the figures as PNG files here")
    p.set_defaults(func=run)
