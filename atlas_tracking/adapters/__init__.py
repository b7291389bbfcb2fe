"""Model-family adapters: the RoutedLayer protocol and a registry keyed by MoE block class.

``base`` holds the protocol and the registry; ``families`` the transformers family table (data, read by
``hf.HFLayer``, with the router semantics of ``routers``). Adapters for other frameworks (DeepSpeed, AutoEP,
Megatron-Core, LitGPT, torchtitan) live in ``atlas_tracking.integrations`` and are plugins: each is named
under the ``atlas_tracking.families`` entry-point group and imported the first time the registry is read,
so this package never imports an integration (none imports its framework: blocks are matched by class name).
"""

from atlas_tracking.adapters import families  # noqa: F401  (registers the transformers families)
from atlas_tracking.adapters.base import (
    NoRoutedLayersError,
    RoutedLayer,
    Routing,
    find_routed_layers,
    register_family,
    registered_families,
)

__all__ = [
    "NoRoutedLayersError",
    "RoutedLayer",
    "Routing",
    "find_routed_layers",
    "register_family",
    "registered_families",
]
