"""Receipts of the same model and canary measured under different world sizes, parallelism or sharding.

Such runs differ in batch layout and kernel order, so their floats differ in the last digits: they are
compared within a tolerance per receipt (docs/receipts.md#tolerances-across-world-sizes), never bit for bit.
``deviations(a, b)`` walks two gate reports (``GateReport.to_json()`` dicts) and returns, per receipt
name, the largest absolute difference over layers, CIs, the summary and the drift section.
"""

from __future__ import annotations

import math
from typing import Any

FLOAT_TOL = 1e-5
"""Absolute tolerance of every real-valued receipt and CI bound (all are O(1): cosines, distances, ratios,
nats, margins in score units) and of the canary NLL."""
EXACT = 0.0
"""Counts and sets: loads, dead experts, cells, excluded/dropped/violating tokens, anchors that changed."""

SKIP = {"per_window", "anchors", "gate_seconds", "gate_share", "fingerprint", "config", "canary", "step", "selfcheck"}
"""Sections that are inputs or bookkeeping, not receipts (per-window arrays are what the receipts derive from).
``selfcheck`` holds the adapter's rounding-level errors against the model's forward, a diagnostic: under
expert parallelism its recombination check evaluates only tokens whose experts are all held locally, so
which tokens it samples depends on the placement."""


def tolerance(value: Any) -> float:
    """The tolerance of one leaf: exact for integers, booleans and strings, ``FLOAT_TOL`` for floats."""
    return FLOAT_TOL if isinstance(value, float) else EXACT


def _walk(a: Any, b: Any, name: str, out: dict[str, float], where: str) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            raise AssertionError(f"{where}: keys differ: {sorted(set(a) ^ set(b))}")
        for key in a:
            if key in SKIP:
                continue
            leaf = f"ci.{key}" if name == "ci" else key  # a CI bound is named after its receipt
            _walk(a[key], b[key], leaf, out, f"{where}.{key}")
        return
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            raise AssertionError(f"{where}: lengths differ ({len(a)} vs {len(b)})")
        for i, (x, y) in enumerate(zip(a, b)):
            _walk(x, y, name, out, f"{where}[{i}]")
        return
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None or isinstance(a, str):
        dev = 0.0 if a == b else math.inf
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)):
        fa, fb = float(a), float(b)
        if math.isfinite(fa) and math.isfinite(fb):
            dev = abs(fa - fb)
        else:  # NaN or infinite: equal only to the same
            dev = 0.0 if fa == fb or (math.isnan(fa) and math.isnan(fb)) else math.inf
        if isinstance(a, int) and isinstance(b, int):
            dev = dev if dev == 0 else math.inf
    else:
        raise AssertionError(f"{where}: {type(a).__name__} vs {type(b).__name__}")
    out[name] = max(out.get(name, 0.0), dev)
    if dev > tolerance(a):
        out.setdefault("_violations", []).append(f"{where}: {a!r} vs {b!r}")  # type: ignore[arg-type]


def deviations(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Largest absolute deviation per receipt between two reports; ``_violations`` lists what is out of tolerance."""
    out: dict[str, Any] = {}
    for section in ("layers", "summary", "drift"):
        _walk(a.get(section), b.get(section), section, out, section)
    return out


def assert_within_tolerance(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    devs = deviations(a, b)
    problems = devs.pop("_violations", [])
    assert not problems, "receipts out of tolerance:\n" + "\n".join(problems[:20])
    return devs
