"""``atlas-tracking report``: a self-contained HTML page for a run or one receipts file.

Without ``--out`` the page goes beside what it reads: ``report.html`` in the run's atlas directory (beside
``gates.jsonl``: ``RUN/atlas/report.html`` for a Lightning root), or the receipts file's name with ``.html``; the
path written is printed either way.

Example:
    >>> default_out("run/receipts/step_00000010.safetensors").as_posix()
    'run/receipts/step_00000010.html'
"""

from __future__ import annotations

import argparse
from pathlib import Path

from atlas_tracking.artifacts.history import gates_file
from atlas_tracking.artifacts.missing_reference import missing_lines, missing_references
from atlas_tracking.artifacts.receipts_file import FORMS
from atlas_tracking.viz.html_report import write_report

REPORT = "report.html"
"""The report's file name in the run's atlas directory."""


def default_out(source: str | Path) -> Path:
    """Where the report of ``source`` goes when ``--out`` is not given: ``report.html`` beside the run's
    ``gates.jsonl``, or the receipts file with the suffix ``.html``."""
    source = Path(source)
    if source.suffix in FORMS:
        return source.with_suffix(".html")
    return gates_file(source).with_name(REPORT)


def run(args: argparse.Namespace) -> int:
    path = write_report(args.source, args.out or default_out(args.source), args.png_dir, args.docs_url)
    print(f"wrote {path}")
    if Path(args.source).suffix not in FORMS:
        for line in missing_lines(missing_references(args.source)):
            print(line)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="self-contained HTML report of a run directory or a receipts artifact")
    p.add_argument("source", help="run directory (with atlas/gates.jsonl) or a receipts artifact "
                   "(.json or .safetensors)")
    p.add_argument("--out", help=f"HTML file to write (default: {REPORT} beside the run's gates.jsonl, e.g. "
                   f"RUN/atlas/{REPORT}; for a receipts artifact, its name with .html)")
    p.add_argument("--png-dir", help="also write the figures as PNG files here")
    p.add_argument("--docs-url", help="base URL of the documentation site the report's links point to (default: "
                   "$ATLAS_DOCS_URL, else the checkout's built site/ or docs/; docs/cli.md#report)")
    p.set_defaults(func=run)
