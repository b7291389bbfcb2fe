"""A real gate pair whose second gate reads bad: one expert per layer of a tiny Qwen3-MoE made to take more routes
(load CV up, C2 down, no expert dead), read with zero tolerances so the run is revoked and names a first
intervention. The report's tests read it."""

from __future__ import annotations

import torch

from atlas_tracking.schema.config import AtlasConfig

STRICT = AtlasConfig.from_dict({
    "receipts": {"progress": False, "n_bootstrap": 100, "anchors": 32},
    "policy": {"phase": "post_training", "c2_tol": 0.0, "dead_tol": 0.0, "entropy_tol": 0.0, "cv_tol": 0.0,
               "use_ci": False},
})
"""Zero tolerances: the gate after the baseline reads bad and the run enters revoked."""


def overload_expert(model, canary, expert: int, shift: float) -> None:
    """Raise one expert's router logit by ``shift`` at the mean router input of each layer (no expert dies)."""
    means: dict[int, torch.Tensor] = {}
    hooks = [lay.mlp.gate.register_forward_pre_hook(
        lambda _m, args, i=i: means.update({i: args[0].reshape(-1, args[0].shape[-1]).mean(0)}))
        for i, lay in enumerate(model.model.layers)]
    with torch.no_grad():
        model(torch.as_tensor(canary.windows))
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        for i, lay in enumerate(model.model.layers):
            lay.mlp.gate.weight[expert] += shift * means[i] / means[i].dot(means[i])
