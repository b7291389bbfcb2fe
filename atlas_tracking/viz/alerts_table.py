"""A run's alerts as one readable HTML table (what MLflow shows as ``atlas/alerts.html``): step, level, title, the
gate's verdict when the alert was raised (:func:`~atlas_tracking.schema.verdict.gate_verdict`) and the full text.

Example:
    >>> page = alerts_page([{"step": 12, "level": "ERROR", "title": "atlas: intervene at step 12",
    ...                      "text": "Intervene or stop claiming progress.", "verdict": "RED (stage intervene)"}], "alerts")
    >>> page.split("<tbody>")[1].split("</tr>")[0]
    '<tr><td>12</td><td>ERROR</td><td>atlas: intervene at step 12</td><td>RED (stage intervene)</td><td>Intervene or stop claiming progress.</td>'
"""

from __future__ import annotations

import html
from typing import Any

from atlas_tracking.viz.html_report import _page, _table

COLUMNS = ("step", "level", "title", "verdict", "text")
"""The table's columns, one row per alert in the order raised."""


def alerts_page(alerts: list[dict[str, Any]], title: str) -> str:
    """A self-contained HTML page: the title and one table row per alert (:data:`COLUMNS`)."""
    rows = [[a.get(c, "-") for c in COLUMNS] for a in alerts]
    return _page(title, f"<h1>{html.escape(title)}</h1>{_table(list(COLUMNS), rows)}")
