"""``atlas-tracking replay``: the gate policy over a recorded sequence, JSON lines out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from atlas_tracking.artifacts.io import write_atomic
from atlas_tracking.cli.common import load_config
from atlas_tracking.decisions.replay import read_gates, replay


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    lines = [json.dumps(d, allow_nan=False) for d in replay(read_gates(args.gates), cfg)]
    text = "\n".join(lines) + "\n"
    if args.out:
        write_atomic(Path(args.out), text)
    else:
        sys.stdout.write(text)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="run the gate policy over a gates JSONL file (one decision per line out)")
    p.add_argument("gates", help="JSON lines: step, c2, dead_experts, min_entropy, mean_cv, loss (first = baseline)")
    p.add_argument("--config", help="atlas YAML config (policy tolerances, alert rules)")
    p.add_argument("--out", help="write the decisions here instead of stdout")
    p.set_defaults(func=run)
