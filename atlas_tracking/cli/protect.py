"""``atlas-tracking protect``: a protected set proposed from a run's whole record (the rule of
``protected_layers: auto``), the set in force, and the configuration line that adopts the proposal."""

from __future__ import annotations

import argparse
import json
import sys

from atlas_tracking.decisions.protection import ProtectionError, protect, table
from atlas_tracking.schema.config import AtlasConfig


def run(args: argparse.Namespace) -> int:
    try:
        cfg = AtlasConfig.from_yaml(args.config) if args.config else None
        result = protect(args.run, cfg)
    except (ProtectionError, ValueError, OSError) as exc:
        print(f"atlas-tracking protect: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, allow_nan=False) if args.json else table(result))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("protect", help="propose a protected set from a run's record (the rule of protected_layers: "
                                       "auto), and how to adopt it (exit 2 on bad input)")
    p.add_argument("run", help="the run's atlas directory or its gates.jsonl")
    p.add_argument("--config", help="atlas YAML config (lifecycle.auto_* settings)")
    p.add_argument("--json", action="store_true", help="print one JSON object (proposal, set in force, adopt line, per-layer reasons)")
    p.set_defaults(func=run)
