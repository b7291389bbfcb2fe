"""``atlas-tracking judge``: is the candidate run a real fix of the stressed one?"""

from __future__ import annotations

import argparse
import json
import sys

from atlas_tracking.decisions.judge import (
    DEFAULT_LOSS_TOL,
    EXIT_CODES,
    NOT_COMPARABLE,
    JudgeError,
    judge,
    table,
)
from atlas_tracking.schema.config import AtlasConfig


def run(args: argparse.Namespace) -> int:
    try:
        cfg = AtlasConfig.from_yaml(args.config) if args.config else None
        result = judge(args.stressed, args.candidate, cfg, args.loss_tol)
    except (JudgeError, ValueError, OSError) as exc:
        print(f"atlas-tracking judge: error: {exc}", file=sys.stderr)
        return EXIT_CODES[NOT_COMPARABLE]
    print(json.dumps(result, allow_nan=False) if args.json else table(result))
    return EXIT_CODES[result["verdict"]]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("judge", help="is a candidate run a real fix of a stressed run? (exit 0 real fix, 1 not yet, "
                                     "2 not comparable or bad input)")
    p.add_argument("--stressed", required=True, help="the stressed run: its atlas directory or gates.jsonl")
    p.add_argument("--candidate", required=True, help="the candidate run: its atlas directory or gates.jsonl")
    p.add_argument("--config", help="atlas YAML config (policy tolerances; n_recover = gates persistence needs)")
    p.add_argument("--loss-tol", type=float, default=DEFAULT_LOSS_TOL,
                   help=f"gates are at matched loss when their losses differ by at most this (default {DEFAULT_LOSS_TOL})")
    p.add_argument("--json", action="store_true", help="print one JSON object (verdict, checks, pairs)")
    p.set_defaults(func=run)
