"""The ``atlas-tracking`` command line: one sub-command per module of this package, plus plugins.

Errors are one line on stderr with exit code 2; ``verify`` exits 1 on a disagreement; ``judge`` exits 0 for
a real fix, 1 for not yet, 2 for not comparable. Each command module exposes ``register(subparsers)``,
which adds its parser and sets ``func``. Commands that need an integration (``wandb-workspace``) are
plugins: installed packages name their ``register`` under the ``atlas_tracking.commands`` entry-point
group, so the command line never imports an integration itself.

>>> sorted(build_parser()._subparsers._group_actions[0].choices)[:4]
['compare', 'du', 'gates', 'judge']
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

from atlas_tracking.cli import compare, du, gates, judge, measure, pin, protect, replay, report, show, verify
from atlas_tracking.cli.common import EXIT_ERROR, CLIError

COMMANDS = (measure, verify, show, compare, replay, report, judge, protect, gates, du, pin)
"""The command modules of this package, in the order ``--help`` lists them."""

PLUGIN_GROUP = "atlas_tracking.commands"
"""Entry-point group of commands that live in integrations (each entry is a ``register(subparsers)``)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atlas-tracking", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    for entry in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        entry.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CLIError, ValueError, OSError, KeyError, FloatingPointError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"atlas-tracking {args.command}: error: {msg}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
