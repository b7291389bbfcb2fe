"""Model-family adapters: the RoutedLayer protocol and a registry keyed by MoE block class."""

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
