"""``atlas-tracking show``: a receipts artifact of either form as its JSON text, or written in the other form.

Example:
    >>> import contextlib, io, tempfile
    >>> from pathlib import Path
    >>> from atlas_tracking.cli import main
    >>> err = io.StringIO()
    >>> with contextlib.redirect_stderr(err):
    ...     main(["show", str(Path(tempfile.mkdtemp()) / "gone.safetensors")])
    2
    >>> "cannot read receipts artifact" in err.getvalue()
    True
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from atlas_tracking.artifacts.gate_report import read_artifact
from atlas_tracking.artifacts.io import write_atomic
from atlas_tracking.artifacts.receipts_file import encode, form_of


def run(args: argparse.Namespace) -> int:
    data = read_artifact(args.receipts)
    if args.out is None:
        print(json.dumps(data, separators=(",", ":"), allow_nan=False))
        return 0
    form, raw = encode(data, "safetensors" if form_of(args.out) == "safetensors" else "json", 0)
    write_atomic(Path(args.out), raw)
    print(f"wrote {args.out} ({form} form, {len(raw)} bytes)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="print a receipts artifact (.json or .safetensors) as JSON, or convert it")
    p.add_argument("receipts", help="receipts artifact (.json or .safetensors)")
    p.add_argument("--out", help="write it here instead: .safetensors writes the binary form, any other name JSON")
    p.set_defaults(func=run)
