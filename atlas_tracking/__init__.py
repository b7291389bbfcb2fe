"""atlas_tracking: exact MoE atlas receipts for the training stacks MoE teams already use.

The public surface: measure a model on a canary (:func:`measure`, :class:`Canary`, :class:`AtlasConfig`,
:class:`Baseline`, :class:`GateReport`), run gates from a training loop (:class:`AtlasGate`,
:class:`ValidationGates`), read a run back (:func:`read_history`, :func:`judge`), compare a rollout engine's routing with the
trainer's (:func:`rollout_agreement`), and teach the engine a new
MoE block (:class:`RoutedLayer`, :class:`Routing`, :func:`register_family`). Framework callbacks and
tracker sinks are in ``atlas_tracking.integrations``; the definitions are in ``docs/``.

>>> from atlas_tracking import AtlasConfig, AtlasGate, Canary, measure
"""

from importlib.metadata import version as _installed_version

from atlas_tracking.adapters import (
    NoRoutedLayersError,
    RoutedLayer,
    Routing,
    find_routed_layers,
    register_family,
)
from atlas_tracking.artifacts.baseline import Baseline, BaselineError
from atlas_tracking.artifacts.gate_report import ArtifactError, GateReport, read_artifact, verify
from atlas_tracking.artifacts.history import read_history
from atlas_tracking.callbacks import LossSource, ValidationGates
from atlas_tracking.compat import install as _keep_old_module_paths
from atlas_tracking.decisions.judge import judge
from atlas_tracking.engine.canary import Canary, CanaryError
from atlas_tracking.engine.measure import RouterLogitsError, measure
from atlas_tracking.engine.rollout import RolloutInputError, rollout_agreement
from atlas_tracking.engine.selfcheck import AdapterCheckError
from atlas_tracking.gate import AtlasGate
from atlas_tracking.schema.config import AtlasConfig, ConfigError

__all__ = [
    "AdapterCheckError",
    "ArtifactError",
    "AtlasConfig",
    "AtlasGate",
    "Baseline",
    "BaselineError",
    "Canary",
    "CanaryError",
    "ConfigError",
    "GateReport",
    "LossSource",
    "NoRoutedLayersError",
    "RolloutInputError",
    "RoutedLayer",
    "RouterLogitsError",
    "Routing",
    "ValidationGates",
    "find_routed_layers",
    "judge",
    "measure",
    "read_artifact",
    "read_history",
    "register_family",
    "rollout_agreement",
    "verify",
]
__version__ = _installed_version("atlas-tracking")
"""The installed distribution's version: ``version`` in ``pyproject.toml`` is its one source."""

_keep_old_module_paths()  # 0.1 module paths (atlas_tracking.gate_report, ...) with a DeprecationWarning
