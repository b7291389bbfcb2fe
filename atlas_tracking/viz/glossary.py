"""The docs' glossary links: on every page but the glossary, the first use of each glossary term links to its
entry (``docs/glossary.md``), so a new user meets no word the site has not defined.

The docs build (``docs/hooks.py``) reads the terms from the glossary's ``###`` headings: a heading names one term
or several separated by ``" / "`` (``### State1 / State2 / State3``), each linked to that heading's anchor.
A term is matched as a whole word (a plural ``s`` allowed), case-sensitively except for its first letter, and
never inside code, a heading, an existing link, an HTML tag or a longer term (``chart`` is not linked inside
``chart-preserving``).

Example:
    >>> terms = glossary_terms("### Atlas\\ntext\\n### Chart / chart-preserving\\n", lambda h: h.lower().replace(" / ", "-"))
    >>> terms
    {'Atlas': 'atlas', 'Chart': 'chart-chart-preserving', 'chart-preserving': 'chart-chart-preserving'}
    >>> print(link_terms("The atlas: a chart-preserving run keeps each chart; `atlas` in code; the atlas again.", terms))
    The [atlas](glossary.md#atlas): a [chart-preserving](glossary.md#chart-chart-preserving) run keeps each [chart](glossary.md#chart-chart-preserving); `atlas` in code; the atlas again.
"""

from __future__ import annotations

import re
from collections.abc import Callable

GLOSSARY = "glossary.md"
"""The glossary page, relative to the docs directory."""

SKIP = re.compile(r"`[^`\n]*`|\[[^\]\n]*\]\([^)\n]*\)|<[^>\n]*>|https?://\S+|\batlas[-_/.]\w|\w[-_/.]atlas\b")
"""Spans never linked inside: inline code, links, HTML tags, URLs, and names built on ``atlas`` (``atlas-tracking``,
``atlas/c2``)."""


def glossary_terms(markdown: str, slugify: Callable[[str], str]) -> dict[str, str]:
    """Term -> anchor, from the ``###`` headings of the glossary page (``slugify``: the docs' heading anchors)."""
    terms: dict[str, str] = {}
    for line in markdown.splitlines():
        if line.startswith("### "):
            heading = line[4:].strip()
            for term in heading.split(" / "):
                terms[term.strip()] = slugify(heading)
    return terms


def _pattern(term: str) -> re.Pattern[str]:
    head = f"[{term[0].upper()}{term[0].lower()}]" if term[0].isalpha() else re.escape(term[0])
    return re.compile(rf"(?<![\w/.-]){head}{re.escape(term[1:])}(?:s|es)?(?![\w-])")


def _skipped(lines: list[str]) -> list[bool]:
    """Per line: whether it is never linked (a fenced code block, a heading, an HTML comment or a table rule)."""
    out, fenced = [], False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
            out.append(True)
            continue
        out.append(fenced or stripped.startswith(("#", "<!--", "|---", "    ")))
    return out


def link_terms(markdown: str, terms: dict[str, str], page: str = GLOSSARY) -> str:
    """``markdown`` with the first use of each term linked to its glossary entry (``page``: the glossary's path
    relative to the page)."""
    lines = markdown.splitlines(keepends=True)
    skipped = _skipped(lines)
    starts, pos = [], 0
    for line in lines:
        starts.append(pos)
        pos += len(line)
    blocked = [(starts[i], starts[i] + len(line)) for i, line in enumerate(lines) if skipped[i]]
    blocked += [m.span() for m in SKIP.finditer(markdown)]
    taken: list[tuple[int, int, str]] = []
    for term in sorted(terms, key=len, reverse=True):
        for m in _pattern(term).finditer(markdown):
            a, b = m.span()
            if any(x < b and a < y for x, y in blocked) or any(x < b and a < y for x, y, _ in taken):
                continue
            taken.append((a, b, f"[{m.group(0)}]({page}#{terms[term]})"))
            break
    out, pos = [], 0
    for a, b, link in sorted(taken):
        out += [markdown[pos:a], link]
        pos = b
    return "".join(out) + markdown[pos:]
