"""NaN or Inf router logits fail the gate with an error naming the layer."""

from __future__ import annotations

import pytest
import torch

from atlas_tracking import (
    RouterLogitsError,
    measure,
)
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.tiny import SMALL_GATE, random_canary


def test_nan_router_logits_name_the_layer():
    model = family_model("qwen3_moe")
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight[2, :] = float("nan")
    with pytest.raises(RouterLogitsError, match=r"routed layer\(s\): model\.layers\.1\.mlp \(\d+ tokens\)$"):
        measure(model, random_canary(), config=SMALL_GATE)
