"""``python -m atlas_tracking.cli``: the same as the ``atlas-tracking`` command."""

import sys

from atlas_tracking.cli import main

sys.exit(main())
