"""MkDocs hook: each ``<!-- generated: NAME -->`` line becomes the table ``atlas_tracking.viz.reference`` makes, and
on every page but the glossary the first use of each glossary term links to its entry
(``atlas_tracking.viz.glossary``).

The configuration keys, the gate record's fields, the tracker keys and the family table are generated from
the code at every build, so the pages cannot drift from it.
"""

from __future__ import annotations

from pathlib import Path

from markdown.extensions.toc import slugify

from atlas_tracking.viz.glossary import GLOSSARY, glossary_terms, link_terms
from atlas_tracking.viz.reference import expand


def on_page_markdown(markdown, page, config, files):
    markdown = expand(markdown)
    if page.file.src_uri == GLOSSARY:
        return markdown
    terms = glossary_terms((Path(config["docs_dir"]) / GLOSSARY).read_text(), lambda text: slugify(text, "-"))
    return link_terms(markdown, terms)
