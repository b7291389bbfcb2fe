"""Console tables: three significant digits, signs as a column's property."""

from __future__ import annotations

from atlas_tracking.viz.tables import format_table


def test_tables_sign_a_column_consistently():
    table = format_table(["c2", "dc2"], [[0.166, 0.0128], [0.0972, -0.0074], [0.150, 0.0]])
    rows = [line.split() for line in table.splitlines()[2:]]
    assert [r[0] for r in rows] == ["0.166", "0.0972", "0.150"]
    assert [r[1] for r in rows] == ["+0.0128", "-0.0074", "0.000"]
