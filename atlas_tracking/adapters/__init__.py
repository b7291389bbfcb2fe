"""Model-family adapters: the RoutedLayer protocol and a registry keyed by MoE block class.

``base`` holds the protocol and the registry; ``families`` the transformers family table (data, read by
``hf.HFLayer``, with the router semantics of ``routers``); the adapters for other frameworks live in
``atlas_tracking.integrations`` (DeepSpeed, AutoEP, Megatron-Core, LitGPT, torchtitan). Importing this
package registers all of them (none imports its framework: blocks are matched by class name).
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
from atlas_tracking.integrations import autoep, deepspeed, litgpt, megatron, torchtitan  # noqa: F401  (their blocks)

__all__ = [
    "NoRoutedLayersError",
    "RoutedLayer",
    "Routing",
    "find_routed_layers",
    "register_family",
    "registered_families",
]
