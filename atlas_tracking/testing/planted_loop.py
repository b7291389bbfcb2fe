"""A short plain training loop whose routing collapses between gates and recovers: real ``load.jsonl`` intervals
with an alarm, its early gate and its clearing, for the views that read them (the report, ``atlas-tracking gates``).

A tiny DeepSeek-V3 model trains (forwards in training mode; the routes are what the telemetry counts) on random
token ids with ``AtlasGate.step`` after every step and intervals of :data:`EVERY` steps. After step
:data:`PLANT_AT` its first routed layer routes every token to experts 0 and 1
(:func:`~atlas_tracking.testing.collapse.plant_collapse`); the alarm is raised :data:`CONSECUTIVE` intervals later
and its early gate runs at that step (:data:`RESTORE_AT`, on the collapsed router); after it the router's bias is
put back, and the alarm clears :data:`CONSECUTIVE` intervals later. Gates: ``start`` at 0, the early one, ``validation`` at
:data:`VALIDATE_AT`.

Example:
    >>> import tempfile
    >>> from atlas_tracking.artifacts.load_record import read_load
    >>> out = planted_loop(Path(tempfile.mkdtemp()) / "atlas")
    >>> [(line["step"], [a["level"] for a in line["alerts"]]) for line in read_load(out) if line["alerts"]]
    [(10, ['WARN']), (14, ['INFO'])]
"""

from __future__ import annotations

from pathlib import Path

import torch

from atlas_tracking.gate import AtlasGate
from atlas_tracking.testing.collapse import plant_collapse
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.tiny import random_canary

EVERY = 2
"""Optimizer steps per interval."""
CONSECUTIVE = 2
"""Intervals in breach before the alarm (and calm ones before it clears)."""
PLANT_AT = 6
"""The step after which the first routed layer routes every token to experts 0 and 1."""
RESTORE_AT = 10
"""The step (and early gate) after which its router's bias is as before."""
VALIDATE_AT = 12
"""The scheduled gate after the start's."""
STEPS = 14
"""Optimizer steps of the loop."""
CONFIG = {"receipts": {"progress": False, "n_bootstrap": 50, "anchors": 16}, "policy": {"phase": "post_training"},
          "telemetry": {"every_n_steps": EVERY, "consecutive": CONSECUTIVE}}
"""A cheap gate read against the start's baseline; intervals of :data:`EVERY` steps."""


def planted_loop(out_dir: str | Path, batch: tuple[int, int] = (4, 16), seed: int = 0) -> Path:
    """Run the loop with its run directory at ``out_dir`` (returned); ``batch`` is (sequences, tokens) per step."""
    model = family_model("deepseek_v3", seed=seed)
    gate = AtlasGate(model, random_canary(n=4), CONFIG, out_dir=out_dir)
    gate.run(0, trigger="start")
    layer = gate.layers[0]
    saved = layer.router.e_score_correction_bias.detach().clone()
    ids = torch.Generator().manual_seed(seed)
    for step in range(1, STEPS + 1):
        model.train()(torch.randint(0, model.config.vocab_size, batch, generator=ids))
        gate.step(step)  # the early gate runs here, at the step whose interval raised the alarm
        if step == VALIDATE_AT:
            gate.run(step)
        if step == PLANT_AT:
            plant_collapse(layer)
        if step == RESTORE_AT:
            with torch.no_grad():
                layer.router.e_score_correction_bias.copy_(saved)
    gate.finish()
    return Path(out_dir)
