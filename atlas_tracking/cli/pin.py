"""``atlas-tracking pin``: keep a run's baselines at a step from retention (docs/record.md#retention)."""

from __future__ import annotations

import argparse

from atlas_tracking.artifacts.history import gates_file
from atlas_tracking.artifacts.retention import pin
from atlas_tracking.artifacts.run_dir import RunDir
from atlas_tracking.cli.common import CLIError


def run(args: argparse.Namespace) -> int:
    run_dir = RunDir(gates_file(args.run).parent)
    held = sorted(p.name for p in run_dir.baselines.glob(f"step_{args.step:08d}.*") if p.is_dir())
    if not held and not args.remove:
        raise CLIError(f"{run_dir.baselines} holds no baseline at step {args.step}")
    steps = pin(run_dir.path, args.step, unpin=args.remove)
    verb = "unpinned" if args.remove else "pinned"
    print(f"{verb} step {args.step} ({', '.join(held) or 'no baseline'}); pinned steps: "
          f"{', '.join(map(str, steps)) or 'none'}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pin", help="keep the baselines of a step on disk whatever gate.keep_baselines says")
    p.add_argument("run", help="the run's atlas directory, a Lightning root or its gates.jsonl")
    p.add_argument("step", type=int, help="the step of the baseline to keep")
    p.add_argument("--remove", action="store_true", help="unpin the step instead (retention may then remove it)")
    p.set_defaults(func=run)
