"""The family registry: a model without a registered MoE block is one clear error."""

from __future__ import annotations

import pytest
import torch

from atlas_tracking import (
    find_routed_layers,
    measure,
)
from atlas_tracking.testing.tiny import SMALL_GATE, random_canary


def test_unknown_family_is_an_error():
    from atlas_tracking.adapters import NoRoutedLayersError

    with pytest.raises(NoRoutedLayersError, match="register an adapter"):
        measure(torch.nn.Sequential(torch.nn.Linear(4, 4)), random_canary(), config=SMALL_GATE)


def test_no_routed_layer_error_names_the_public_function():
    with pytest.raises(ValueError, match=r"register an adapter with atlas_tracking\.register_family") as info:
        find_routed_layers(torch.nn.Linear(4, 4))
    assert "atlas_tracking.adapters.register_family" not in str(info.value)
    import atlas_tracking

    assert callable(atlas_tracking.register_family)
