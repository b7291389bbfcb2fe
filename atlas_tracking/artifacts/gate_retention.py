"""What a gate's retention keeps and removes (docs/record.md#retention), read on rank zero from the run directory.

Example:
    >>> import tempfile
    >>> from atlas_tracking.artifacts.run_dir import RunDir
    >>> from atlas_tracking.schema.config import AtlasConfig
    >>> plan, fields = retention_plan(RunDir(tempfile.mkdtemp()), AtlasConfig(), [], [])
    >>> plan.baselines, sorted(fields["retention"])
    ([], ['keep_baselines', 'keep_receipts', 'pinned'])
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from atlas_tracking.artifacts.handoff_reference import pinned_step
from atlas_tracking.artifacts.retention import Plan, pinned_steps, pruned_note, step_of
from atlas_tracking.artifacts.run_dir import RunDir
from atlas_tracking.schema.config import AtlasConfig

log = logging.getLogger("atlas_tracking")


def pruned_reference(baseline_path: str | None) -> str | None:
    """At a resume whose restored reference retention removed: that folder and the gate that pruned it."""
    note = pruned_note(baseline_path) if baseline_path else None
    if note is None:
        return None
    log.warning("atlas: the restored reference %s was %s; the resume gate is a new baseline with no drift "
                "against it", baseline_path, note)
    return f"{baseline_path}: {note}"


def in_run_dir(config: AtlasConfig, folder: Path) -> str | None:
    """The first name under ``folder`` of a declared handoff reference path that lives there, else None."""
    spec = config.lifecycle.handoff_reference
    if spec is None or pinned_step(spec) is not None:
        return None
    try:
        return Path(spec).resolve().relative_to(folder.resolve()).parts[0]
    except (ValueError, IndexError):
        return None


def kept_baselines(run_dir: RunDir, config: AtlasConfig, lineage: list[list[Any]], current: list[str | None]) -> set[str]:
    """Folder names under ``baselines/`` that stay: the ``current`` references (the baseline, the post-training base),
    a declared handoff reference in this run directory and the history's last ``gate.keep_baselines`` baselines."""
    names = [run_dir.baseline_dir(int(s), b).name for s, b in lineage]
    recent = [n for n in names if (run_dir.baselines / n).is_dir()][-config.gate.keep_baselines:]
    kept = {Path(p).name for p in current if p} | set(recent)
    inside = in_run_dir(config, run_dir.baselines)
    return kept | ({inside} if inside else set())


def retention_plan(run_dir: RunDir, config: AtlasConfig, lineage: list[list[Any]],
                   current: list[str | None]) -> tuple[Plan, dict[str, Any]]:
    """What this gate's retention removes and the record fields that name it."""
    gate = config.gate
    pinned = pinned_steps(run_dir.path, gate.pin_baselines)
    fields: dict[str, Any] = {"retention": {"keep_baselines": gate.keep_baselines,
                                            "keep_receipts": gate.keep_receipts, "pinned": sorted(pinned)}}
    try:
        plan = Plan.of_baselines(run_dir.path, kept_baselines(run_dir, config, lineage, current), pinned)
        steps = [int(s) for s, _ in lineage]
        if gate.keep_receipts is not None and len(steps) > gate.keep_receipts:
            reference = in_run_dir(config, run_dir.receipts)
            keep = {pinned_step(config.lifecycle.handoff_reference or ""), step_of(reference) if reference else None}
            plan.add_receipts(run_dir.path, steps[-gate.keep_receipts], {s for s in keep if s is not None})
    except OSError as exc:
        log.warning("atlas: retention cannot read %s (%s); nothing pruned at this gate", run_dir.path, exc)
        return Plan(), fields
    return plan, {**fields, **plan.fields()}
