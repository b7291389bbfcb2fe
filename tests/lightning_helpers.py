"""Shared pieces for the Lightning tests: a tiny MoE LightningModule, loaders and a canary."""

from __future__ import annotations

import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

from demo_data import encode, prose_text  # noqa: E402
from moe_lightning import MoELM, build_qwen3_moe, loaders  # noqa: E402

from atlas_tracking import Canary  # noqa: E402

PROSE = encode(prose_text())


def tiny_module(seed: int = 0, aux_coef: float = 0.02) -> MoELM:
    model = build_qwen3_moe(seed=seed, hidden=32, layers=2, experts=8, aux_coef=aux_coef)
    return MoELM(model, lr=3e-3, aux_coef=aux_coef)


def tiny_data(steps: int, seed: int = 0):
    return loaders(PROSE[:200_000], PROSE[200_000:260_000], window=32, batch=8, steps=steps, seed=seed, val_windows=8)


def tiny_canary() -> Canary:
    return Canary.from_token_ids(PROSE[300_000:], window=32, n_windows=8, seed=0)


QUIET = {"receipts": {"progress": False, "n_bootstrap": 200, "anchors": 64}}
POST_TRAINING = {**QUIET, "policy": {"phase": "post_training"}}
"""Gates read against the step-0 baseline (a random tiny model is read in pretraining by default, where the
reference rolls forward gate to gate)."""
