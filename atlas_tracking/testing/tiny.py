"""The tiny set-up most tests use: a 2-layer, 8-expert MoE LightningModule, byte-level prose loaders and a canary."""

from __future__ import annotations

import numpy as np

from atlas_tracking.engine.canary import Canary
from atlas_tracking.schema.config import AtlasConfig
from atlas_tracking.testing.demo_data import encode, prose_text
from atlas_tracking.testing.lightning_lm import MoELM, build_qwen3_moe, loaders

PROSE = encode(prose_text())


def tiny_module(seed: int = 0, aux_coef: float = 0.02) -> MoELM:
    model = build_qwen3_moe(seed=seed, hidden=32, layers=2, experts=8, aux_coef=aux_coef)
    return MoELM(model, lr=3e-3, aux_coef=aux_coef)


def tiny_data(steps: int, seed: int = 0):
    return loaders(PROSE[:200_000], PROSE[200_000:260_000], window=32, batch=8, steps=steps, seed=seed, val_windows=8)


def tiny_canary() -> Canary:
    return Canary.from_token_ids(PROSE[300_000:], window=32, n_windows=8, seed=0)


QUIET = {"receipts": {"progress": False, "n_bootstrap": 200, "anchors": 64}, "telemetry": {"early_gate": False}}
"""A cheap gate, and no early gate: the tiny model's routing collapses within tens of steps at its learning rate, which
the training-batch alarm rightly reports; the tests of other features keep their gates where they scheduled them
(the early gate has tests of its own, which set ``telemetry`` themselves)."""
POST_TRAINING = {**QUIET, "policy": {"phase": "post_training"}}
"""Gates read against the step-0 baseline (a random tiny model is read in pretraining by default, where the
reference rolls forward gate to gate)."""


SMALL_GATE = AtlasConfig.from_dict({"receipts": {"progress": False, "n_bootstrap": 100, "anchors": 32}})
"""A cheap gate for the tiny family models of :mod:`atlas_tracking.testing.families`."""


def random_canary(n: int = 4, window: int = 16, vocab: int = 64, seed: int = 0) -> Canary:
    """``n`` windows of ``window`` random token ids below ``vocab`` (the tiny family models' vocabulary is 64)."""
    return Canary.from_token_ids(np.random.default_rng(seed).integers(0, vocab, 5000), window=window, n_windows=n)
