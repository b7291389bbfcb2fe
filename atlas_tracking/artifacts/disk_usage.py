"""What a run directory holds and what it costs on disk (``atlas-tracking du``; docs/record.md#retention).

Bytes are the sizes of regular files (``os.lstat``; the ``baseline`` link counts 0), split by kind: baselines
(each folder with its step and whether it is the current reference, the post-training base or pinned),
receipts artifacts (``receipts/``, abandoned ones included), ``gates.jsonl``, the other JSON-lines files,
``evaluations.jsonl`` and the rest; the kinds add up to ``total``.

Example:
    >>> import tempfile
    >>> from atlas_tracking.artifacts.history import append_line
    >>> from atlas_tracking.artifacts.io import write_atomic
    >>> run = Path(tempfile.mkdtemp())
    >>> append_line(run / "gates.jsonl", {"step": 0, "branch": "a"})
    >>> _ = write_atomic(run / "receipts" / "step_00000000.json", "{}")
    >>> usage = disk_usage(run)
    >>> usage["bytes"]["receipts"], usage["gates"], usage["bytes_per_gate"]["last"] == usage["total"]
    (2, 1, True)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from atlas_tracking.artifacts.history import gates_file, read_history
from atlas_tracking.artifacts.receipts_file import FORMS
from atlas_tracking.artifacts.retention import pinned_steps, step_of, tree_bytes
from atlas_tracking.artifacts.run_dir import RunDir
from atlas_tracking.schema.artifacts import EVALUATIONS, GATES, LOAD, LOAD_ABANDONED, RECORD_FILES
from atlas_tracking.schema.config import GateConfig

KINDS = ("baselines", "receipts", "gates", "load", "other_jsonl", "evaluations", "rest")
"""The kinds ``disk_usage`` splits a run directory's bytes into, in the order it lists them."""


def _handoff_name(history: list[dict[str, Any]]) -> str | None:
    """The post-training base: the baseline of the history's first post-training BASELINE gate."""
    for rec in history:
        if rec.get("status") == "BASELINE" and rec.get("phase") == "post_training" and rec.get("baseline_path"):
            return Path(rec["baseline_path"]).name
    return None


def _baselines(run: RunDir, history: list[dict[str, Any]], pinned: set[int]) -> list[dict[str, Any]]:
    current = Path(os.readlink(run.current_baseline)).name if run.current_baseline.is_symlink() else None
    handoff = _handoff_name(history)
    rows = []
    for path in sorted(run.baselines.iterdir()) if run.baselines.is_dir() else []:
        step = step_of(path.name)
        roles = [role for role, held in (("current", path.name == current), ("handoff", path.name == handoff),
                                         ("pinned", step in pinned)) if held]
        rows.append({"name": path.name, "step": step, "bytes": tree_bytes(path), "roles": roles})
    return rows


def _last_gate_bytes(run: RunDir, history: list[dict[str, Any]]) -> int:
    """What the last gate added: its line, its receipts artifact and the baseline folder it made, if any."""
    if not history:
        return 0
    last = history[-1]
    line = run.gates.read_bytes().rstrip(b"\n").rpartition(b"\n")[2]
    made = run.baseline_dir(int(last["step"]), str(last.get("branch")))
    return len(line) + 1 + tree_bytes(run.receipts_file(int(last["step"]))) + tree_bytes(made)


def disk_usage(path: str | Path) -> dict[str, Any]:
    """Bytes per kind, the baselines, the number of gates, bytes per gate and the retention in force."""
    run = RunDir(gates_file(path).parent)
    history = read_history(run.path)
    recorded = next((r["retention"] for r in reversed(history) if "retention" in r), None)
    defaults = GateConfig()
    retention = recorded or {"keep_baselines": defaults.keep_baselines, "keep_receipts": defaults.keep_receipts,
                             "pinned": sorted(pinned_steps(run.path)), "recorded": False}
    baselines = _baselines(run, history, set(retention["pinned"]) | pinned_steps(run.path))
    total = tree_bytes(run.path)
    by_kind = {"baselines": tree_bytes(run.baselines), "receipts": tree_bytes(run.receipts),
               "gates": tree_bytes(run.gates), "evaluations": tree_bytes(run.path / EVALUATIONS),
               "load": tree_bytes(run.path / LOAD) + tree_bytes(run.path / LOAD_ABANDONED),
               "other_jsonl": sum(tree_bytes(run.path / n) for n in RECORD_FILES
                                  if n not in (GATES, EVALUATIONS, LOAD, LOAD_ABANDONED))}
    by_kind["rest"] = total - sum(by_kind.values())
    n = len(history)
    return {"run_dir": str(run.path), "total": total, "bytes": {k: by_kind[k] for k in KINDS},
            "baselines": baselines, "receipts_files": sum(1 for suffix in FORMS for _ in run.receipts.rglob(f"*{suffix}")),
            "gates": n, "bytes_per_gate": {"mean": total / n if n else None, "last": _last_gate_bytes(run, history)},
            "retention": retention}
