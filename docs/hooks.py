"""MkDocs hook: each ``<!-- generated: NAME -->`` line becomes the table ``atlas_tracking.viz.reference`` makes.

The configuration keys, the gate record's fields, the tracker keys and the family table are generated from
the code at every build, so the pages cannot drift from it.
"""

from __future__ import annotations

from atlas_tracking.viz.reference import expand


def on_page_markdown(markdown, page, config, files):
    return expand(markdown)
