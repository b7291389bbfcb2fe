"""Links from a report to the documentation: every ``docs/PAGE.md#anchor`` a sentence cites and every table row a
rule names ("Table 11 row 2") become links to the page and section that define them.

Where the links point (docs/cli.md#report), first match wins:

1. the ``docs_url`` a caller passes (``atlas-tracking report --docs-url URL``),
2. the environment variable ``ATLAS_DOCS_URL`` (a served or published copy of the site, e.g.
   ``https://docs.example.org/atlas/``),
3. the site ``make docs`` built in the checkout the package runs from (``<checkout>/site/``, as a ``file://``
   URL),
4. the Markdown pages of that checkout (``<checkout>/docs/``),
5. else the repository-relative path the sentence cites (``docs/policy.md#the-judge``).

A site base is read the way MkDocs lays pages out: ``policy.md#the-judge`` is ``BASE/policy/#the-judge``.

Example:
    >>> links = DocsLinks("https://docs.example.org/atlas/")
    >>> links.href("docs/policy.md#the-judge"), links.href("docs/index.md")
    ('https://docs.example.org/atlas/policy/#the-judge', 'https://docs.example.org/atlas/')
    >>> print(links.linked("classifies each candidate (docs/policy.md#the-judge)"))
    classifies each candidate (<a href="https://docs.example.org/atlas/policy/#the-judge">docs/policy.md#the-judge</a>)
    >>> links.linked("Table 11 row 2: a persistent bad plateau").split(">")[0]
    '<a href="https://docs.example.org/atlas/policy/#interpretations" title="docs/policy.md#interpretations"'
"""

from __future__ import annotations

import html
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ENV = "ATLAS_DOCS_URL"
"""The environment variable that names the documentation site's base URL."""

CHECKOUT = Path(__file__).resolve().parents[2]
"""The directory above the package: a checkout when the package runs from one."""

TABLE_SECTIONS = {"3": "worked-example-distill-640", "4": "licensed-and-unlicensed-claims", "10": "handoff-readiness",
                  "11": "interpretations", "13": "stage-transitions", "14": "first-interventions"}
"""The section of docs/policy.md that states each of the technical report's tables the policy follows."""

DOC_REF = re.compile(r"docs/([\w-]+)\.md(#[\w-]+)?")
TABLE_REF = re.compile(r"Table (\d+)((?: rows? [\d-]+)?)")


def default_base() -> tuple[str, bool]:
    """The base URL (and whether it holds Markdown pages rather than a built site) when none is passed."""
    if os.environ.get(ENV):
        return os.environ[ENV], False
    if (CHECKOUT / "site" / "index.html").is_file():
        return (CHECKOUT / "site").as_uri() + "/", False
    if (CHECKOUT / "docs" / "index.md").is_file():
        return (CHECKOUT / "docs").as_uri() + "/", True
    return "docs/", True


@dataclass(frozen=True)
class DocsLinks:
    """Turns documentation references into links against one base (a built site unless ``markdown``)."""

    base: str
    markdown: bool = False

    @classmethod
    def resolve(cls, docs_url: str | None = None) -> DocsLinks:
        """The links for ``docs_url``, else the default base (:func:`default_base`)."""
        if docs_url:
            return cls(docs_url if docs_url.endswith("/") else docs_url + "/")
        return cls(*default_base())

    def href(self, ref: str) -> str:
        """The URL of ``docs/PAGE.md#anchor`` (or ``PAGE.md#anchor``) under the base."""
        page, _, anchor = ref.removeprefix("docs/").partition("#")
        page = page.removesuffix(".md")
        tail = f"#{anchor}" if anchor else ""
        if self.markdown:
            return f"{self.base}{page}.md{tail}"
        return f"{self.base}{'' if page == 'index' else page + '/'}{tail}"

    def a(self, ref: str, text: str) -> str:
        """An HTML link to ``ref`` reading ``text`` (escaped)."""
        return f'<a href="{html.escape(self.href(ref))}">{html.escape(text)}</a>'

    def linked(self, text: str, escape: Callable[[str], str] = html.escape) -> str:
        """``text`` with each ``docs/PAGE.md#anchor`` and each ``Table N row M`` a link, the rest through
        ``escape`` (HTML escaping, or a function that also marks up the rest)."""
        out, pos = [], 0
        refs = sorted([*DOC_REF.finditer(text), *TABLE_REF.finditer(text)], key=lambda m: m.start())
        for m in refs:
            if m.start() < pos:
                continue
            out.append(escape(text[pos:m.start()]))
            if m.re is DOC_REF:
                out.append(self.a(m.group(0), m.group(0)))
            else:
                section = TABLE_SECTIONS.get(m.group(1))
                ref = f"docs/policy.md#{section}" if section else "docs/policy.md"
                out.append(f'<a href="{html.escape(self.href(ref))}" title="{ref}">{html.escape(m.group(0))}</a>')
            pos = m.end()
        return "".join(out) + escape(text[pos:])
