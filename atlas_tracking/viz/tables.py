"""Plain-text tables for the console: one row per routed layer, one row per gate.

Numbers get three significant digits below 0.1 and three decimals above. Signs are a column's
property: a column that holds a negative number shows every non-zero number with its sign
(a delta reads ``+0.0128`` beside ``-0.0074``), any other column shows none (``0.0972`` beside
``0.166``).

Example:
    >>> print(format_table(["a", "b", "delta"], [[1, 0.5, 0.0128], [None, 0.0972, -0.0074]]))
    a  b       delta
    -  ------  -------
    1  0.500   +0.0128
    -  0.0972  -0.0074
"""

from __future__ import annotations

from typing import Any

from atlas_tracking.receipts.windows import TOP1

NA_TOP1 = "n/a (top-1)"
"""What a view shows where C2 would be at top-1 routing (docs/receipts.md#top-1-routing-and-zero-computation-experts)."""


def top1(record: dict[str, Any]) -> bool:
    """A record or receipts summary whose C2 is absent because of top-1 routing (its ``c2_absent``).

    >>> top1({"c2": None, "c2_absent": "top-1 routing"}), top1({"c2": 0.1})
    (True, False)
    """
    return record.get("c2_absent") == TOP1


def c2_cell(value: Any, is_top1: bool) -> Any:
    """A C2 value (or a value derived from C2) as a view shows it: :data:`NA_TOP1` in place of an absent one at
    top-1 routing, else as it is.

    >>> c2_cell(None, True), c2_cell(None, False), c2_cell(0.1, True)
    ('n/a (top-1)', None, 0.1)
    """
    return NA_TOP1 if value is None and is_top1 else value


LAYER_COLUMNS: list[tuple[str, str]] = [
    ("dead_experts", "dead"),
    ("load_cv", "load_cv"),
    ("router_entropy", "H"),
    ("margin_mean", "margin"),
    ("c2", "c2"),
    ("v2_c1", "v2_c1"),
    ("v2_c2", "v2_c2"),
    ("ov_cf", "ov_cf"),
    ("transition_incompat", "jump"),
]


def _cell(value: Any, signed: bool) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "pass" if value else "fail"
    if isinstance(value, float):
        sign = "+" if signed and value != 0 else ""
        return f"{value:{sign}.4f}" if abs(value) < 0.1 and value != 0 else f"{value:{sign}.3f}"
    if signed and isinstance(value, int) and value > 0:
        return f"+{value}"
    return str(value)


def _negative(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0


def format_table(header: list[str], rows: list[list[Any]]) -> str:
    """Left-aligned columns separated by two spaces; a column with a negative number is signed throughout."""
    signed = [any(_negative(row[i]) for row in rows) for i in range(len(header))]
    cells = [header] + [[_cell(v, signed[i]) for i, v in enumerate(row)] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def layer_table(layers: list[dict[str, Any]]) -> str:
    """Per-layer receipts of a gate (V2 axes shown with their pass/fail)."""
    header = ["layer", "E", "k", "prot"] + [short for _, short in LAYER_COLUMNS]
    rows = []
    for layer in layers:
        r = layer["receipts"]
        row: list[Any] = [layer["name"], layer["num_experts"], layer["top_k"], "*" if layer.get("protected") else ""]
        for key, _ in LAYER_COLUMNS:
            value = c2_cell(r.get(key), layer.get("top_k") == 1) if key == "c2" else r.get(key)
            if key.startswith("v2_") and value is not None:
                value = f"{value:+.4f} {'pass' if r.get(key + '_pass') else 'fail'}"
            row.append(value)
        rows.append(row)
    return format_table(header, rows)


def summary_line(summary: dict[str, Any]) -> str:
    """One line: C2, dead experts, min entropy, mean load CV (in %), margin, canary NLL (and, against a
    baseline, the canary NLL delta and ``kl_base``)."""
    def f(key: str, fmt: str) -> str:
        v = summary.get(key)
        if v is None and key == "c2" and top1(summary):
            return NA_TOP1
        return "-" if v is None else format(v, fmt)

    line = (
        f"c2={f('c2', '.4f')} dead={f('dead_experts', '.1f')} min_H={f('min_entropy', '.3f')} "
        f"cv%={f('mean_cv', '.1f')} margin={f('margin', '.4f')} nll={f('canary_nll', '.4f')}"
    )
    if "canary_nll_delta" in summary:
        line += f" nll_delta={f('canary_nll_delta', '+.4f')} kl_base={f('kl_base', '.4g')}"
    return line
