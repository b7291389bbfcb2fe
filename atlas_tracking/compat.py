"""Module paths of atlas-tracking 0.1, kept importable with a ``DeprecationWarning`` naming the new path.

Version 0.2 moved the flat modules into folders that say their layer (``docs/architecture.md``). Code
written against 0.1 keeps working: ``from atlas_tracking.gate_report import verify`` imports a stand-in
module that forwards every attribute to :mod:`atlas_tracking.artifacts.gate_report`. The stand-ins are
made on first import only; nothing here imports the modules it names until then. ``atlas_tracking.sinks``
and ``atlas_tracking.cli`` are folders now and re-export what their modules held. Two old paths are not
kept: ``atlas_tracking.measure`` and ``atlas_tracking.judge`` are the package's functions of those names (a
module of the same name would replace them); import them from ``atlas_tracking``.

Example:
    >>> import sys, warnings
    >>> _ = sys.modules.pop("atlas_tracking.gate_report", None)  # a fresh import, so its warning is seen
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     from atlas_tracking.gate_report import verify
    >>> verify.__module__, str(caught[0].message).split(";")[0]
    ('atlas_tracking.artifacts.gate_report', 'atlas_tracking.gate_report moved to atlas_tracking.artifacts.gate_report')
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

MOVED = {
    "atlas_tracking.config": "atlas_tracking.schema.config",
    "atlas_tracking.canary": "atlas_tracking.engine.canary",
    "atlas_tracking.anchors": "atlas_tracking.engine.anchors",
    "atlas_tracking.capture": "atlas_tracking.engine.capture",
    "atlas_tracking.fields": "atlas_tracking.engine.fields",
    "atlas_tracking.sharding": "atlas_tracking.engine.sharding",
    "atlas_tracking.selfcheck": "atlas_tracking.engine.selfcheck",
    "atlas_tracking.param_reference": "atlas_tracking.engine.param_reference",
    "atlas_tracking.compare": "atlas_tracking.engine.lineage",
    "atlas_tracking.policy": "atlas_tracking.decisions.policy",
    "atlas_tracking.phases": "atlas_tracking.decisions.phases",
    "atlas_tracking.alerts": "atlas_tracking.decisions.alerts",
    "atlas_tracking.protection": "atlas_tracking.decisions.protection",
    "atlas_tracking.replay": "atlas_tracking.decisions.replay",
    "atlas_tracking.report": "atlas_tracking.viz.html_report",
    "atlas_tracking.figures": "atlas_tracking.viz.figures",
    "atlas_tracking.tables": "atlas_tracking.viz.tables",
    "atlas_tracking.record": "atlas_tracking.artifacts.record",
    "atlas_tracking.history": "atlas_tracking.artifacts.history",
    "atlas_tracking.gate_report": "atlas_tracking.artifacts.gate_report",
    "atlas_tracking.baseline": "atlas_tracking.artifacts.baseline",
    "atlas_tracking.host_threads": "atlas_tracking.artifacts.derivation",
    "atlas_tracking.checkpoints": "atlas_tracking.cli.checkpoints",
}
"""Old module path -> the module that holds its contents now."""


class _Forward(ModuleType):
    """A stand-in for an old module path: every attribute is read from the module it moved to."""

    def __init__(self, name: str, target: ModuleType):
        super().__init__(name, f"moved to {target.__name__}")
        self._target = target

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._target, attr)

    def __dir__(self) -> list[str]:
        return dir(self._target)


class OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old module paths of :data:`MOVED` (and nothing else)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path will be removed in a later version",
                      DeprecationWarning, stacklevel=2)
        return _Forward(spec.name, importlib.import_module(new))

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the stand-in forwards to a module that is already imported."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``import atlas_tracking`` does it)."""
    if not any(isinstance(f, OldPathFinder) for f in sys.meta_path):
        sys.meta_path.append(OldPathFinder())
