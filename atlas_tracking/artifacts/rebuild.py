"""A gate whose line a crash cut short, rebuilt from its whole receipts file at the next resume.

The receipts file (``receipts/step_N.json``) is written atomically before the gate's line, so when a crash
cuts that line, the file is whole. The rebuilt record is the gate record of those receipts
(:func:`~atlas_tracking.artifacts.record.gate_record`) with what the cut line still holds (``loss``,
``resume``, ``baseline_path``, ``run_id``, ``branch``, ...), the run's id, the branch a tracker noted in
``delivered.jsonl`` when the line lost it, and ``rebuilt`` saying so (the caller adds the file's sha256). A gate without a
whole receipts file or a branch is lost: the resume says so in one warning and the line is only cut.

Example:
    >>> prefix_fields('{"schema_version":3,"step":40,"loss":2.5,"resume":false,"c2":0.01,"layers":[{"na')
    {'schema_version': 3, 'step': 40, 'loss': 2.5, 'resume': False, 'c2': 0.01}
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from atlas_tracking.artifacts.gate_report import ArtifactError, GateReport
from atlas_tracking.artifacts.history import read_lines
from atlas_tracking.artifacts.record import gate_record

log = logging.getLogger("atlas_tracking")

_SCALAR = re.compile(r'"(\w+)":("(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null)(?=[,}])')
"""A top-level ``"key":scalar`` pair of a record line (nested objects are read only up to their first scalar)."""

KEPT = ("step", "loss", "resume", "baseline_path", "run_id", "branch", "log_step", "canary_changed_from")
"""The fields a rebuilt record takes from the cut line (everything else comes from the receipts)."""


def prefix_fields(torn: str) -> dict[str, Any]:
    """The top-level scalar fields of a cut record line, up to where it was cut (nested ones are skipped)."""
    out: dict[str, Any] = {}
    depth = 0
    i = 0
    while i < len(torn):
        ch = torn[i]
        if ch == '"' and depth == 1:
            match = _SCALAR.match(torn, i)
            if match:
                out.setdefault(match.group(1), json.loads(match.group(2)))
                i = match.end()
                continue
            i = torn.index('"', i + 1) + 1 if '"' in torn[i + 1:] else len(torn)  # a key: skip it
            continue
        if ch == '"':  # a string inside a nested value: skip it whole
            end = re.match(r'"(?:[^"\\]|\\.)*"', torn[i:])
            i += end.end() if end else len(torn)
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        i += 1
    return out


def rebuild_cut_gate(run: Any, torn: str) -> dict[str, Any] | None:
    """The record of the gate whose line ``torn`` is (``run`` a :class:`~atlas_tracking.artifacts.run_dir.RunDir`),
    rebuilt from its receipts file; None, with one warning, when it cannot be (the gate is lost)."""
    kept = {k: v for k, v in prefix_fields(torn).items() if k in KEPT}
    step = kept.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        log.warning("atlas: a gate line cut short by a crash names no step; that gate is lost (%d bytes cut)",
                    len(torn.encode()))
        return None
    path: Path = run.receipts_file(step)
    try:
        report = GateReport.load(path)
    except (ArtifactError, OSError) as exc:
        log.warning("atlas: the gate at step %s was cut short by a crash and its receipts file is not whole "
                    "(%s); that gate is lost", step, exc)
        return None
    if kept.get("branch") is None:
        recorded = {(r["step"], r.get("branch")) for name in (run.gates, run.abandoned) for r in read_lines(name)}
        noted = [d.get("branch") for d in read_lines(run.delivered)
                 if d["step"] == step and (step, d.get("branch")) not in recorded]
        if not noted or noted[-1] is None:
            log.warning("atlas: the gate at step %s was cut short by a crash before its branch was written and no "
                        "tracker noted it; that gate is lost (its receipts stay in %s)", step, path)
            return None
        kept["branch"] = noted[-1]
    record: dict[str, Any] = dict(gate_record(report, None, step=step, loss=kept.get("loss"),
                                              resume=bool(kept.get("resume", False)),
                                              baseline_path=kept.get("baseline_path")))
    record.update(kept)
    record["run_id"] = kept.get("run_id") or run.owner()[1]
    record["rebuilt"] = (f"the line was cut by a crash after {len(torn.encode())} bytes; rebuilt at a resume from "
                         f"{path.name} ({', '.join(sorted(kept))} from the cut line)")
    return record

