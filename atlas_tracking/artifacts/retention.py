"""Retention: which baselines and receipts artifacts of a run stay on disk, and removing the rest safely.

In pretraining every gate becomes the next gate's reference, so without retention a run writes one baseline
folder per gate and never removes one (docs/record.md#retention). A prune keeps the current reference, the
post-training base (the handoff baseline), a declared handoff reference that lives in the run directory, every
pinned step (``gate.pin_baselines`` and ``atlas-tracking pin``, kept in ``pins.json``) and the last
``gate.keep_baselines`` references of the history; with ``gate.keep_receipts: N`` it also removes receipts
artifacts older than the history's last N gates (``gates.jsonl`` is never touched). The gate names what it
prunes in its record line (``pruned_baselines``, ``pruned_receipts``, ``pruned_bytes``) before anything is
removed, then renames each victim to a temporary name and removes it: a crash leaves an extra folder or a
temporary one (``RunDir.repair`` removes those), never a missing reference.

Example:
    >>> import tempfile
    >>> run = Path(tempfile.mkdtemp())
    >>> for name in ("step_00000000.a", "step_00000010.a", "step_00000020.a", "step_00000030.a"):
    ...     _ = write_atomic(run / "baselines" / name / "manifest.json", "{}")
    >>> plan = Plan.of_baselines(run, keep={"step_00000030.a", "step_00000020.a"}, pinned={0})
    >>> plan.baselines, plan.bytes
    (['baselines/step_00000010.a'], 2)
    >>> remove(run, plan.baselines + plan.receipts)
    >>> sorted(p.name for p in (run / "baselines").iterdir())
    ['step_00000000.a', 'step_00000020.a', 'step_00000030.a']
    >>> pin(run, 20), pinned_steps(run, [5])
    ([20], {20, 5})
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atlas_tracking.artifacts.history import HistoryError, read_lines
from atlas_tracking.artifacts.io import replace_durably, write_atomic
from atlas_tracking.artifacts.receipts_file import FORMS
from atlas_tracking.schema.artifacts import ABANDONED, GATES, PINS

_STEP = re.compile(r"^step_(\d+)[.](?:json|.+)$")
TRASH_SUFFIX = ".pruned.tmp"
"""A victim is renamed to ``.<name>.pruned.tmp`` before it is removed (``RunDir.repair`` removes leftovers)."""


def step_of(name: str) -> int | None:
    """The step in a baseline folder's or receipts artifact's name.

    >>> step_of("step_00000120.ab12"), step_of("step_00000120.json"), step_of("legacy.x")
    (120, 120, None)
    """
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files at or under ``path`` (links are not followed and count 0)."""
    if path.is_symlink() or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            file = os.path.join(root, name)
            total += 0 if os.path.islink(file) else os.lstat(file).st_size
    return total


# --- pins ------------------------------------------------------------------------------------------------


def _read_pins(run: Path) -> list[int]:
    try:
        return sorted({int(s) for s in json.loads((run / PINS).read_text())["steps"]})
    except (OSError, ValueError, KeyError, TypeError):
        return []


def pin(run: str | Path, step: int, unpin: bool = False) -> list[int]:
    """Pin (or unpin) the baselines at ``step`` of the run directory ``run``; returns the pinned steps."""
    run = Path(run)
    steps = set(_read_pins(run))
    steps = steps - {int(step)} if unpin else steps | {int(step)}
    write_atomic(run / PINS, json.dumps({"steps": sorted(steps)}))
    return sorted(steps)


def pinned_steps(run: str | Path, configured: list[int] | None = None) -> set[int]:
    """The steps whose baselines stay: ``gate.pin_baselines`` and the run's ``pins.json``."""
    return set(configured or []) | set(_read_pins(Path(run)))


# --- what a prune removes --------------------------------------------------------------------------------


@dataclass
class Plan:
    """What one prune removes, as paths relative to the run directory, and the bytes it frees."""

    baselines: list[str] = field(default_factory=list)
    receipts: list[str] = field(default_factory=list)
    bytes: int = 0

    @classmethod
    def of_baselines(cls, run: Path, keep: set[str], pinned: set[int]) -> Plan:
        """Every ``baselines/step_*`` folder neither in ``keep`` (folder names) nor at a pinned step."""
        plan = cls()
        folder = run / "baselines"
        if folder.is_dir():
            for path in sorted(folder.iterdir()):
                step = step_of(path.name)
                if step is None or not path.is_dir() or path.name in keep or step in pinned:
                    continue
                plan.baselines.append(f"baselines/{path.name}")
                plan.bytes += tree_bytes(path)
        return plan

    def add_receipts(self, run: Path, before: int, keep: set[int]) -> None:
        """``receipts/step_N.json`` and ``receipts/step_N.safetensors`` with N < ``before``, except the steps in
        ``keep``."""
        for path in sorted(p for suffix in FORMS for p in (run / "receipts").glob(f"step_*{suffix}")):
            step = step_of(path.name)
            if step is not None and step < before and step not in keep:
                self.receipts.append(f"receipts/{path.name}")
                self.bytes += tree_bytes(path)

    def fields(self) -> dict[str, Any]:
        """The record fields of this prune ({} when it removes nothing)."""
        if not self.baselines and not self.receipts:
            return {}
        out: dict[str, Any] = {"pruned_bytes": self.bytes}
        if self.baselines:
            out["pruned_baselines"] = self.baselines
        if self.receipts:
            out["pruned_receipts"] = self.receipts
        return out


def remove(run: Path, relative: list[str]) -> None:
    """Remove each path: a durable rename to ``.<name>.pruned.tmp`` beside it, then the removal; then any
    such leftover of an earlier prune that did not finish."""
    for rel in relative:
        path = run / rel
        if path.exists() and not path.is_symlink():
            replace_durably(path, path.with_name(f".{path.name}{TRASH_SUFFIX}"))
    for folder in (run / "baselines", run / "receipts"):
        for trash in folder.glob(f".*{TRASH_SUFFIX}") if folder.is_dir() else []:
            if trash.is_dir():
                shutil.rmtree(trash)
            else:
                trash.unlink()


# --- reading the record ----------------------------------------------------------------------------------


def pruned_at(run: str | Path, relative: str) -> int | None:
    """The step of the gate whose record says it pruned ``relative`` (e.g. ``baselines/step_00000010.a``),
    or None when no record of the run says so."""
    run = Path(run)
    for name in (GATES, ABANDONED):
        try:
            records = read_lines(run / name) if (run / name).is_file() else []
        except HistoryError:
            continue
        for rec in records:
            if relative in rec.get("pruned_baselines", []) + rec.get("pruned_receipts", []):
                return int(rec["step"])
    return None


def pruned_note(path: str | Path) -> str | None:
    """For a receipts artifact or baseline that is gone: the sentence saying retention removed it, or None.

    >>> import tempfile
    >>> from atlas_tracking.artifacts.history import append_line
    >>> run = Path(tempfile.mkdtemp())
    >>> append_line(run / "gates.jsonl", {"step": 40, "pruned_receipts": ["receipts/step_00000010.json"]})
    >>> pruned_note(run / "receipts" / "step_00000010.json")
    'pruned by retention (gate.keep_receipts) at the gate of step 40'
    """
    path = Path(path)
    kind = {"receipts": "gate.keep_receipts", "baselines": "gate.keep_baselines"}.get(path.parent.name)
    if kind is None or path.exists():
        return None
    step = pruned_at(path.parent.parent, f"{path.parent.name}/{path.name}")
    return None if step is None else f"pruned by retention ({kind}) at the gate of step {step}"
