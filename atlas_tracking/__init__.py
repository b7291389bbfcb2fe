"""atlas_tracking: exact MoE atlas receipts for the training stacks MoE teams already use.

>>> from atlas_tracking import AtlasConfig, Canary, measure
"""

from atlas_tracking.adapters import NoRoutedLayersError, RoutedLayer, find_routed_layers, register_family
from atlas_tracking.baseline import Baseline, BaselineError
from atlas_tracking.canary import Canary, CanaryError
from atlas_tracking.config import AtlasConfig, ConfigError
from atlas_tracking.gate_report import ArtifactError, GateReport
from atlas_tracking.history import read_history
from atlas_tracking.judge import judge
from atlas_tracking.measure import RouterLogitsError, measure
from atlas_tracking.selfcheck import AdapterCheckError

__all__ = [
    "AdapterCheckError",
    "ArtifactError",
    "AtlasConfig",
    "Baseline",
    "BaselineError",
    "Canary",
    "CanaryError",
    "ConfigError",
    "GateReport",
    "NoRoutedLayersError",
    "RoutedLayer",
    "RouterLogitsError",
    "find_routed_layers",
    "judge",
    "measure",
    "read_history",
    "register_family",
]
__version__ = "0.1.0"
