"""``atlas-tracking judge``: is the candidate run a real fix of the stressed one? (docs/cli.md#judge)

With several ``--candidate`` runs, each is judged against the stressed run and the knowledge-expansive
predicate is read across them; the exit code is the best of their verdicts' (0 when one is a real fix).
"""

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
    judge_many,
    many_table,
    table,
)
from atlas_tracking.schema.config import AtlasConfig


def run(args: argparse.Namespace) -> int:
    try:
        cfg = AtlasConfig.from_yaml(args.config) if args.config else None
        if len(args.candidate) == 1:
            result = judge(args.stressed, args.candidate[0], cfg, args.loss_tol)
        else:
            result = judge_many(args.stressed, args.candidate, cfg, args.loss_tol)
    except (JudgeError, ValueError, OSError) as exc:
        print(f"atlas-tracking judge: error: {exc}", file=sys.stderr)
        return EXIT_CODES[NOT_COMPARABLE]
    several = "candidates" in result
    if args.json:
        print(json.dumps(result, allow_nan=False))
    else:
        print(many_table(result) if several else table(result))
    if several:
        return min(EXIT_CODES[r["verdict"]] for r in result["candidates"])
    return EXIT_CODES[result["verdict"]]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("judge", help="is a candidate run a real fix of a stressed run? (exit 0 real fix, 1 not yet, "
                                     "2 not comparable or bad input)")
    p.add_argument("--stressed", required=True, help="the stressed run: its atlas directory or gates.jsonl")
    p.add_argument("--candidate", required=True, action="extend", nargs="+",
                   help="the candidate run(s): atlas directory or gates.jsonl; several (--candidate A B or "
                        "--candidate A --candidate B) are each judged and classified knowledge-expansive or not")
    p.add_argument("--config", help="atlas YAML config (policy tolerances; n_recover = gates persistence needs)")
    p.add_argument("--loss-tol", type=float, default=DEFAULT_LOSS_TOL,
                   help=f"gates are at matched loss when their losses differ by at most this, and a candidate "
                        f"reaches the stressed run's final loss within it (default {DEFAULT_LOSS_TOL})")
    p.add_argument("--json", action="store_true", help="print one JSON object (verdict, checks, pairs; with "
                                                       "several candidates: target_loss, candidates)")
    p.set_defaults(func=run)
