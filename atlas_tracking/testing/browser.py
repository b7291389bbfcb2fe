"""The report in a real browser: the system Chromium driven by Playwright (the dev extra; no browser download).

:func:`first_screen` opens a report at a fixed viewport and returns where its first-screen parts lie (CSS pixels
from the top of the page), optionally saving a screenshot of the viewport: the check that an operator sees the
verdict, the worst layers and the first intervention without scrolling, and the picture docs/index.md opens with.
"""

from __future__ import annotations

from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
"""The system Chromium the checks drive."""

PARTS = {"verdict": ".status", "worst layers": "table.worst-layers", "load picture": ".where img",
         "first intervention": ".intervention", "first configuration lines": ".intervention pre"}
"""The first screen's parts, by CSS selector."""


def first_screen(report: Path, screenshot: Path | None = None, width: int = 1280,
                 height: int = 900) -> dict[str, dict[str, float] | None]:
    """Per part of :data:`PARTS`, its box (``top``, ``bottom``, ``left``, ``right`` in CSS pixels; None when the
    page lacks it) in ``report`` rendered at ``width`` x ``height``; the viewport saved to ``screenshot`` when
    given. Every image must have loaded, else a RuntimeError names the ones that did not."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(Path(report).resolve().as_uri())
            broken = page.eval_on_selector_all("img", "els => els.filter(e => !e.complete || !e.naturalWidth)"
                                                      ".map(e => e.alt)")
            if broken:
                raise RuntimeError(f"images that did not load: {broken}")
            boxes = {name: page.evaluate(
                "s => { const e = document.querySelector(s); if (!e) return null; const r = e.getBoundingClientRect();"
                " return {top: r.top + scrollY, bottom: r.bottom + scrollY, left: r.left, right: r.right}; }",
                selector) for name, selector in PARTS.items()}
            if screenshot is not None:
                Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(screenshot))
        finally:
            browser.close()
    return boxes
