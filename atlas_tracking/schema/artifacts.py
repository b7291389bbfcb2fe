"""The artifacts a gate writes: their kinds, schema versions, and the names of their sections and tensors.

A receipts artifact (``receipts/step_N.json``, :class:`~atlas_tracking.artifacts.gate_report.GateReport`)
and a baseline directory (:class:`~atlas_tracking.artifacts.baseline.Baseline`) each carry a ``kind`` and a
``schema_version``; a reader refuses another kind and a newer version.

>>> RECEIPTS_KIND, RECEIPTS_SCHEMA_VERSION, BASELINE_KIND
('atlas-receipts', 1, 'atlas-baseline')
"""

from __future__ import annotations

from atlas_tracking.schema.record import BASE_DAMAGE_FIELDS

RECEIPTS_KIND = "atlas-receipts"
RECEIPTS_SCHEMA_VERSION = 1
"""The receipts artifact of one gate (``receipts/step_N.json``)."""

BASELINE_KIND = "atlas-baseline"
BASELINE_SCHEMA_VERSION = 1
"""A baseline directory's ``manifest.json``."""

DRIFT_KIND = "atlas-drift"
DRIFT_SCHEMA_VERSION = 1
"""The document ``atlas-tracking compare`` writes (``drift.json``)."""

BASELINE_TENSORS_FILE = "anchors.safetensors"
BASELINE_MANIFEST_FILE = "manifest.json"

BASE_TENSORS = ("z0", "g0", "R0", "p0", "u0", "b0")
"""Per routed layer and anchor token, what a baseline keeps: the pre-gain state z0, the gate input g0, the
active set R0, the routing distribution p0, the tangent-projected base fields u0 of R0, and base boundary
membership b0 (besides the pre-norm's :data:`NORM_TENSORS`). A compact baseline keeps no g0 and may keep u0 projected
(its manifest's ``anchors.storage``; docs/receipts.md#compact-anchors)."""
NORM_TENSORS = ("gamma0", "beta0")
"""Per routed layer, the pre-norm's parameters at the baseline (fp32): the gain ``gamma0`` and, for a LayerNorm
with a bias, its bias ``beta0`` (absent otherwise; docs/receipts.md#layernorm-state)."""

KL_TENSORS = ("logp", "index", "log_rest")
"""The base model's top-K log-probabilities per canary predicted token, their vocabulary indices, and the log
of the remaining mass (``kl.<name>`` in a baseline)."""

DRIFT_RECEIPTS = ("coord_drift", "boundary_drift", "transition_drift", "content_drift")
"""The four drift functionals between a baseline and now, per routed layer."""

REFERENCE_KEYS = ("c2", "pi_min", "pi_tail_smooth", "dead_experts", "router_entropy", "load_cv", "canary_nll")
"""Per-layer receipts a baseline keeps as the reference of the lifecycle margins."""

BASE_DAMAGE_KEYS = tuple(key for key in BASE_DAMAGE_FIELDS if not key.endswith("_absent"))
"""Drift keys added with base-domain damage: absent from older artifacts, checked when present."""

EXACT_ONLY = ("margin_p10", "margin_p50")
"""Receipts that are exact quantiles of per-token values: reported, but not re-derivable from per-window arrays."""

# --- the run directory (``out_dir``; see atlas_tracking.artifacts.run_dir for its layout) ---

GATES = "gates.jsonl"


ABANDONED = "gates.abandoned.jsonl"


ALERTS = "alerts.jsonl"


ERRORS = "errors.jsonl"


ERRORS_ABANDONED = "errors.abandoned.jsonl"


DELIVERED = "delivered.jsonl"


BACKLOG = "backlog.json"
"""The gates each sink had not received when training ended (written by the delivery's bounded wait)."""


EVALUATIONS = "evaluations.jsonl"


LOAD = "load.jsonl"
"""The training-batch routes of every logging interval between gates (:mod:`atlas_tracking.schema.load`)."""


LOAD_ABANDONED = "load.abandoned.jsonl"
"""Intervals of abandoned branches (a resume from an older checkpoint moves them here)."""


ROLLOUT = "rollout.jsonl"
"""The rollout agreement of every recorded training step (:mod:`atlas_tracking.schema.rollout`)."""


ROLLOUT_ABANDONED = "rollout.abandoned.jsonl"
"""Recorded steps of abandoned branches (a resume from an older checkpoint moves them here)."""


RUN_FILE = "run.json"


PINS = "pins.json"
"""The steps whose baselines retention keeps (``atlas-tracking pin``), beside ``gate.pin_baselines``."""


RECORD_FILES = (GATES, ABANDONED, ALERTS, ERRORS, ERRORS_ABANDONED, DELIVERED, EVALUATIONS, LOAD, LOAD_ABANDONED,
                ROLLOUT, ROLLOUT_ABANDONED)
"""Every JSON-lines file of a run directory (each line a complete JSON object)."""
