"""The ``atlas-tracking`` command line: :mod:`~atlas_tracking.cli.app` builds the parser; one module per command.

>>> from atlas_tracking.cli import main
>>> main(["verify", "/no/such/receipts.json"])
2
"""

from atlas_tracking.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
