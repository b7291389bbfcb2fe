"""The glossary: it defines the words a newcomer meets first, and on every other docs page the first use of each of
its terms (outside code, headings and links) links to its entry, as the docs build renders the page."""

from __future__ import annotations

import re
from pathlib import Path

from markdown.extensions.toc import slugify

from atlas_tracking.viz.glossary import GLOSSARY, SKIP, glossary_terms, link_terms

DOCS = Path(__file__).resolve().parents[3] / "docs"
NEWCOMER = ("Atlas", "State1", "State2", "State3", "V2 axes", "Tangent field", "Co-active chart", "chart-preserving",
            "Terminal cliff", "Occupancy", "C2", "Canary", "Gate", "Stage", "badge")
"""Terms a new user meets on the first pages, each of which the glossary must define."""


def _terms() -> dict[str, str]:
    return glossary_terms((DOCS / GLOSSARY).read_text(), lambda text: slugify(text, "-"))


def test_the_glossary_defines_the_newcomers_words():
    assert set(NEWCOMER) <= set(_terms())
    assert "glossary.md" in (DOCS.parent / "mkdocs.yml").read_text()


def test_every_page_links_the_first_use_of_each_term():
    terms = _terms()
    pages = [p for p in DOCS.glob("*.md") if p.name != GLOSSARY]
    assert len(pages) >= 10
    for page in pages:
        linked = link_terms(page.read_text(), terms)
        for term, anchor in terms.items():
            links = re.findall(rf"\]\(glossary\.md#{re.escape(anchor)}\)", linked)
            # the term's first use in prose (a line outside code fences and headings, not in code or a link)
            prose = "\n".join(line for line in _prose_lines(page.read_text()))
            prose = SKIP.sub(" ", prose)
            used = re.search(rf"(?<![\w/.-]){re.escape(term)}(?![\w-])", prose, flags=re.IGNORECASE)
            if used:
                assert links, (page.name, term)


def _prose_lines(text: str):
    fenced = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced and not line.strip().startswith(("#", "<!--", "|---", "    ")):
            yield line
