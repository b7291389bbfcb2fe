"""The gate record: one JSON object per gate, the line appended to ``atlas/gates.jsonl``.

Declared once, here: each section of the record is a ``TypedDict`` whose fields carry their type and a
docstring (the policy's decision is the dataclass :class:`GateDecision`, which the policy returns); a field
that trackers receive is marked ``Annotated[..., Metric()]``. Every field list the
package uses (what a record copies from a receipts artifact, what reaches a tracker, the docs' tables) is
derived from these declarations. Status, stage and phase are string enums: a record holds their values, so
``record["status"] == Status.GREEN`` and ``json.dumps`` needs nothing special.

Version 2 records state ``schema_version``; a record without one was written by version 1 (the same
fields, unversioned) and is read through :func:`upgrade_record`. A record of a newer version than this
package reads is an error that names both versions.

Units: the summary ``mean_cv`` and ``max_cv`` (and ``mean_cv_delta``) are in the report's unit, the load
CV x 100 (a percentage; the policy's ``cv_tol`` is in it too), while each layer's ``load_cv`` is the plain
fraction; trackers carry the unit in the name (``atlas/mean_cv_pct``).

Example:
    >>> Status.GREEN.code, Stage.intervene.code, Stage.intervene in BAD_STAGES
    (1, 6, True)
    >>> SUMMARY_METRICS[:3], METRIC_NAMES["mean_cv"]
    (('c2', 'c2_min', 'c2_protected'), 'mean_cv_pct')
    >>> upgrade_record({"step": 0})["schema_version"]
    2
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Annotated, Any, TypedDict, get_type_hints

RECORD_SCHEMA_VERSION = 2
"""The version of the records this package writes (a record states it as ``schema_version``)."""


class RecordVersionError(ValueError):
    """A record states a ``schema_version`` this package does not read."""


class Status(str, Enum):
    """A gate's status (its tracker code is the position here)."""

    BASELINE = "BASELINE"
    """A new reference (the first gate, a resume, or every gate in pretraining's rolling reference)."""
    GREEN = "GREEN"
    YELLOW = "YELLOW"
    RED = "RED"
    """C2 worsening, occupancy degrading and the loss stalling."""

    @property
    def code(self) -> int:
        return list(type(self)).index(self)

    def __str__(self) -> str:
        return self.value


class Stage(str, Enum):
    """The staged escalation (post-training) and the pretraining stages (its tracker code is the position)."""

    baseline = "baseline"
    clean = "clean"
    recovering = "recovering"
    revoked = "revoked"
    alert = "alert"
    prepare = "prepare"
    intervene = "intervene"
    forming = "forming"
    ready = "ready"
    collapse = "collapse"
    stable = "stable"
    """Pretraining: every readiness criterion holds but no healthy reference is declared (never "ready")."""

    @property
    def code(self) -> int:
        return list(type(self)).index(self)

    def __str__(self) -> str:
        return self.value


class Phase(str, Enum):
    """The lifecycle phase a gate is read in."""

    pretraining = "pretraining"
    post_training = "post_training"

    def __str__(self) -> str:
        return self.value


VERDICT_CODES = {"pass": 0, "at risk": 1, "fail": 2}
"""Tracker codes of a predicate's verdict (``atlas/predicate/<name>``); ``not measured`` and ``not judged`` send
nothing."""
BAD_STAGES = (Stage.revoked, Stage.alert, Stage.prepare, Stage.intervene)
"""Post-training stages with a revoked preservation claim."""
PRETRAINING_STAGES = (Stage.forming, Stage.stable, Stage.ready, Stage.collapse)
STATUS_CODES = {s.value: s.code for s in Status}
STAGE_CODES = {s.value: s.code for s in Stage}


@dataclass(frozen=True)
class Metric:
    """Marks a record field that trackers receive as ``atlas/<name>`` (``name``: when it differs from the field)."""

    name: str | None = None


# --- the sections of a record ----------------------------------------------------------------------


class LayerIdentity(TypedDict):
    """Which routed layer a per-layer entry is."""

    name: str
    """Module path of the MoE block (``model.layers.3.mlp``)."""
    index: int
    """Decoder-layer index read from the path (-1 when it has none)."""
    ordinal: int
    """Position among the routed layers in forward order (``atlas/layer_NN/...``)."""
    protected: bool
    """In the protected set of this gate (``lifecycle.protected_layers``)."""
    num_experts: int | None
    """Routed experts of the layer (E)."""
    top_k: int | None
    """Experts each token selects (k)."""


class LayerReceipts(TypedDict, total=False):
    """Per-layer receipts a record copies from the gate's receipts artifact."""

    c2: Annotated[float | None, Metric()]
    """Co-active overlap compatibility (State2)."""
    dead_experts: Annotated[int, Metric()]
    """Experts that no canary token selected."""
    experts_active: int
    """Experts that at least one canary token selected (E minus dead)."""
    router_entropy: Annotated[float, Metric()]
    """Entropy of the load shares, nats."""
    load_cv: Annotated[float, Metric()]
    """Population CV of the expert loads (a fraction)."""
    pi_min: float
    """The smallest expert occupancy."""
    margin_mean: Annotated[float, Metric()]
    """Mean set margin (State1, selection-score units)."""
    near_tie: dict[str, float | None]
    """Near-tie mass (State1): per precision (``bf16``, ``fp16``), the share of counted tokens whose set margin lies
    within that precision's rounding of a tie, ``|m| <= eps (|s_k| + |s_k1|)``."""
    near_tie_tokens: dict[str, int]
    """The counts behind ``near_tie``: near-tie tokens per precision and the ``counted`` tokens they are a share of."""
    ov_cf: Annotated[float, Metric()]
    """Routing self-consistency."""
    v2_c1: float | None
    """V2 C1: boundary minus interior redundancy distance of the swap pair (more negative passes more strongly)."""
    v2_c2: float | None
    """V2 C2: boundary swap-pair distance minus a random eligible competitor's (the kill-shot)."""
    v2_c1_pass: bool | None
    """The 95% CI upper bound of ``v2_c1`` is below 0."""
    v2_c2_pass: bool | None
    """The 95% CI upper bound of ``v2_c2`` is below 0."""
    transition_incompat: float | None
    """Median one-swap jump over the boundary set, relative to the routed update."""
    dropped_routes: int
    """Routes a capacity limit dropped (DeepSpeed MoE)."""
    no_random_competitor: int
    """Boundary tokens with no eligible random competitor (out of V2 C2)."""
    zero_expert_pairs: int
    """V2 pairs (e_k, e_k1) and (e_k, e_rand) with a zero-computation expert on either side (out of V2)."""
    alignment: list[float | None]
    """Per expert, the cosine between its router row (in the state space of the receipts) and the mean angular state
    of the canary tokens routed to it; None for a dead expert (docs/receipts.md#alignment)."""
    alignment_median: float | None
    """Median of ``alignment`` over the experts that have one."""
    alignment_p10: float | None
    """Lower decile of ``alignment`` over the experts that have one."""
    alignment_negative: float | None
    """Share of the experts with an alignment whose router row points away from their tokens (alignment < 0)."""
    alignment_dead: list[int]
    """The experts left out of the alignment figures: no canary token was routed to them."""
    alignment_absent: str
    """Why the layer has no alignment (its router holds no rows to read); there only then."""


BOUNDARY_MASS_KEY = "boundary_mass@0.01"
"""The one ``boundary_mass@delta`` a record copies (its name is not an identifier, so it is listed here)."""


class LayerDrift(TypedDict, total=False):
    """Per-layer drift against the gate's baseline."""

    coord_drift: float
    """Mean 1 - cos between the gate inputs of the baseline and now at the anchors (transport)."""
    boundary_drift: Annotated[float, Metric()]
    """Mean share of the active set that changed at the base-anchored states (routing)."""
    transition_drift: float
    """Mean Jensen-Shannon divergence of the routing distributions at the base-anchored states (nats)."""
    content_drift: float
    """Mean 0.9-quantile over the base active set of the relative change of the tangent fields (experts)."""
    c2_delta: Annotated[float | None, Metric()]
    """C2 now minus C2 at the baseline (paired on the canary windows)."""
    dead_experts_delta: float
    """Dead experts now minus at the baseline."""
    comove_state: float | None
    """Median over the experts of the cosine between the change of the router row and the change of the expert's
    mean angular state since the baseline (docs/receipts.md#co-movement); None when no expert's row and state moved."""
    comove_state_against: float | None
    """Share of the compared experts whose router row moved against their tokens (that cosine < 0)."""
    comove_field: float | None
    """As ``comove_state``, with the change of the expert's mean tangent field."""
    comove_field_against: float | None
    """Share of the compared experts whose row moved against the change of their mean field."""
    comove_router_still: int
    """Experts whose router row did not move at all since the baseline (all of them under a frozen router)."""
    comove_absent: str
    """Why the layer has no co-movement (an older baseline, or no router rows); there only then."""


class LayerExperts(TypedDict, total=False):
    """Per-expert loads of a routed layer on the canary: which expert carries the layer (the report's and the
    trackers' layers x experts heatmap, the experts an alert names)."""

    expert_load: list[int]
    """Routes each expert received over the canary windows (its share is its load over the layer's total)."""
    expert_load_baseline: list[int]
    """``expert_load`` at the gate's baseline: each share's change is read against it."""


class LayerRecord(LayerIdentity, LayerReceipts, LayerDrift, LayerExperts, total=False):
    """One routed layer of a gate record (``record["layers"][i]``)."""


class Summary(TypedDict, total=False):
    """Cross-layer summaries of a gate (bounded: independent of depth), as the receipts artifact has them."""

    c2: Annotated[float | None, Metric()]
    """Mean C2 over the routed layers."""
    c2_min: Annotated[float | None, Metric()]
    """The smallest per-layer C2."""
    c2_protected: Annotated[float | None, Metric()]
    """Mean C2 over the protected layers."""
    c2_absent: str
    """Why C2 is absent (``c2``, ``c2_min``, ``c2_protected``, ``c2_delta`` and their CIs are None): "top-1
    routing" when every routed layer selects one expert; there only then."""
    dead_experts: Annotated[float, Metric()]
    """Mean dead experts per routed layer."""
    dead_experts_max: Annotated[float, Metric()]
    """Dead experts of the worst routed layer."""
    experts_active: Annotated[float, Metric()]
    """Mean active experts per routed layer."""
    min_entropy: Annotated[float, Metric()]
    """The smallest router entropy over the routed layers (nats)."""
    mean_entropy: Annotated[float, Metric()]
    """Mean router entropy over the routed layers (nats)."""
    mean_cv: Annotated[float, Metric("mean_cv_pct")]
    """Mean load CV x 100."""
    max_cv: Annotated[float, Metric("max_cv_pct")]
    """Largest load CV x 100."""
    margin: Annotated[float | None, Metric()]
    """Mean State1 margin over the routed layers."""
    near_tie_bf16: Annotated[float | None, Metric()]
    """Mean over the routed layers of the share of counted tokens within bf16 rounding of a tie."""
    near_tie_bf16_max: Annotated[float | None, Metric()]
    """The largest per-layer share of counted tokens within bf16 rounding of a tie."""
    near_tie_fp16: Annotated[float | None, Metric()]
    """Mean over the routed layers of the share of counted tokens within fp16 rounding of a tie."""
    near_tie_fp16_max: Annotated[float | None, Metric()]
    """The largest per-layer share of counted tokens within fp16 rounding of a tie."""
    ov_cf: Annotated[float | None, Metric()]
    """Mean routing self-consistency over the routed layers."""
    transition_incompat: Annotated[float | None, Metric()]
    """Mean transition incompatibility over the routed layers."""
    canary_nll: Annotated[float | None, Metric()]
    """State3: next-token NLL on the canary."""
    v2_c1_pass_layers: Annotated[int, Metric()]
    """Routed layers whose V2 C1 axis passes."""
    v2_c2_pass_layers: Annotated[int, Metric()]
    """Routed layers whose V2 C2 axis passes."""
    loss: Annotated[float | None, Metric()]
    """The gate's objective at this gate: the training framework's validation loss, or the metric ``objective`` names
    (``loss_key``, read in ``objective_direction``); not a receipt; None when none was logged."""
    ov_cf_terminal_jump: Annotated[float | None, Metric()]
    """The terminal routed layer's ov_cf minus the mean of the band before it."""
    ov_cf_adjacent_jump: Annotated[float | None, Metric()]
    """The terminal routed layer's ov_cf minus the layer just before it."""
    alignment_median: Annotated[float | None, Metric()]
    """Mean over the routed layers of the median router-row alignment (docs/receipts.md#alignment)."""
    alignment_p10_min: Annotated[float | None, Metric()]
    """The lowest per-layer lower decile of the router-row alignment."""
    alignment_negative: Annotated[float | None, Metric()]
    """Mean over the routed layers of the share of experts whose router row points away from their tokens."""


class Cliff(TypedDict, total=False):
    """The terminal cliff of ``ov_cf`` kept beside its jumps (the depth profile is the layers' ``ov_cf``)."""

    ov_cf_terminal_jump_ci: list[float] | None
    """Window-bootstrap CI of the terminal jump."""
    ov_cf_adjacent_jump_ci: list[float] | None
    """Window-bootstrap CI of the adjacent jump."""
    ov_cf_terminal_ordinal: int | None
    """Ordinal of the terminal routed layer."""
    ov_cf_cliff_ordinal: int | None
    """Ordinal of the layer with the most negative step in ov_cf (the dominant cliff)."""
    ov_cf_cliff_note: str | None
    """Set when the dominant cliff is not at the terminal routed layer."""


class Deltas(TypedDict, total=False):
    """Paired changes of the policy's summaries against the baseline, with their window-bootstrap CIs."""

    c2_delta: float | None
    """Mean C2 over the routed layers, now minus at the baseline."""
    c2_delta_ci: list[float] | None
    dead_experts_delta: float
    """Mean dead experts per layer, now minus at the baseline."""
    dead_experts_delta_ci: list[float] | None
    min_entropy_delta: float
    """Smallest router entropy, now minus at the baseline."""
    min_entropy_delta_ci: list[float] | None
    mean_cv_delta: float
    """Mean load CV x 100, now minus at the baseline."""
    mean_cv_delta_ci: list[float] | None


class Margins(TypedDict, total=False):
    """The lifecycle margins (positive is inside the boundary)."""

    handoff_margin: Annotated[float | None, Metric()]
    """Min over the protected layers of lam1 (c2 - c2_ref) + lam2 (rho - 1); the occupancy term alone when C2
    is absent (``c2_absent``: top-1 routing)."""
    refine_margin: Annotated[float | None, Metric()]
    """tau - max over the protected layers of mu1 boundary + mu2 content + mu3 (1 - rho)."""
    handoff_layer: str | None
    """The protected layer that sets ``handoff_margin``."""
    refine_layer: str | None
    """The protected layer that sets ``refine_margin``."""
    refine_margin_ci: list[float] | None
    """Window-bootstrap CI of ``refine_margin`` (drift and expert loads of the protected layers resampled)."""
    refine_reference: str
    """What ``refine_margin`` reads against: the post-training base in post-training, else the baseline."""


class BaseDamage(TypedDict, total=False):
    """Damage to the base domain against the baseline."""

    kl_base: Annotated[float | None, Metric()]
    """Bounded KL(base || now) per canary predicted token (a lower bound of the full KL)."""
    kl_base_ci: list[float] | None
    """Window-bootstrap CI of ``kl_base``."""
    canary_nll_delta: Annotated[float | None, Metric()]
    """Canary NLL now minus at the baseline."""
    canary_nll_delta_ci: list[float] | None
    """Paired window-bootstrap CI of ``canary_nll_delta``."""
    kl_base_absent: str
    """Why ``kl_base`` is absent (a baseline saved without the base log-probabilities)."""
    base_step: int | None
    """Post-training: the step of the base (the first post-training baseline), kept across resumes."""
    kl_base_cumulative: Annotated[float | None, Metric()]
    """Bounded KL(base || now) per canary predicted token against the post-training base: the damage since the
    base, across every resume (``kl_base`` is since the latest baseline)."""
    kl_base_cumulative_ci: list[float] | None
    """Window-bootstrap CI of ``kl_base_cumulative``."""
    canary_nll_delta_cumulative: Annotated[float | None, Metric()]
    """Canary NLL now minus at the post-training base."""
    canary_nll_delta_cumulative_ci: list[float] | None
    """Paired window-bootstrap CI of ``canary_nll_delta_cumulative``."""


class CoMovement(TypedDict, total=False):
    """Router-expert co-movement against the baseline across the routed layers (docs/receipts.md#co-movement)."""

    comove_state: Annotated[float | None, Metric()]
    """Mean over the layers of the median cosine between a router row's change and its expert's mean-state change."""
    comove_state_against: Annotated[float | None, Metric()]
    """Mean over the layers of the share of compared experts whose row moved against their tokens."""
    comove_field: Annotated[float | None, Metric()]
    """Mean over the layers of the median cosine between a router row's change and its expert's mean-field change."""
    comove_field_against: float | None
    """Mean over the layers of the share of compared experts whose row moved against their mean field's change."""
    comove_compared: int
    """Experts compared over all routed layers (row and mean state both moved)."""
    comove_router_still: Annotated[int, Metric()]
    """Experts over all routed layers whose router row did not move since the baseline (a frozen router: all)."""


@dataclass
class GateDecision:
    """The policy's reading of one gate (:meth:`GatePolicy.read <atlas_tracking.decisions.policy.GatePolicy.read>`):
    the record holds :meth:`to_dict` without ``step``, enums as plain strings."""

    step: int
    status: Status
    """BASELINE | GREEN | YELLOW | RED."""
    stage: Stage
    """The stage of the staged escalation (or the pretraining stage)."""
    c2_trend: str
    """worsening | stable | improving, or n/a when C2 is absent (``c2_absent``: top-1 routing)."""
    occupancy: str
    """healthy | degrading."""
    loss_trend: str
    """improving | stalling | unknown."""
    action: str
    """What the operator should do at this stage."""
    interpretation: str
    """What the pattern of C2, occupancy and loss means."""
    licensed: list[str]
    """Claims this gate licenses."""
    unlicensed: list[str]
    """Claims this gate does not license."""
    intervention: str | None
    """The first intervention to try, by the observed pattern."""
    worst_layers: list[dict[str, Any]] = field(default_factory=list)
    """The protected layers with the most negative C2 change (at most three)."""
    stage_before_resume: str | None = None
    """A resume gate: the stage the run was in before."""
    alerts: list[dict[str, Any]] = field(default_factory=list)
    """The alerts this gate raised (level, title, text)."""
    phase: Phase = Phase.post_training
    """pretraining | post_training."""
    phase_source: str = ""
    """Why the gate is read in that phase."""
    phase_before_resume: str | None = None
    """A resume that changed the phase (the handoff): the phase before."""
    handoff: dict[str, Any] | None = None
    """Pretraining: handoff readiness (ready, stable_gates, n_stable, margin, reasons)."""
    collapse: list[str] = field(default_factory=list)
    """Pretraining: the routed layers whose occupancy collapsed (empty when none)."""
    rule: str | None = None
    """The table row of the report the stage follows (docs/policy.md#stage-transitions)."""
    predicates: dict[str, Any] | None = None
    """Post-training gates after a baseline: the three predicates (``protected_rewrite``, ``base_damage``,
    ``knowledge_expansive``), each a ``verdict`` with its ``reason`` (docs/policy.md#the-three-predicates)."""

    def __post_init__(self) -> None:
        self.status, self.stage, self.phase = Status(self.status), Stage(self.stage), Phase(self.phase)

    def to_dict(self) -> dict[str, Any]:
        """All fields, the enums as plain strings (what a record and the policy's state hold)."""
        d = asdict(self)
        d.update(status=self.status.value, stage=self.stage.value, phase=self.phase.value)
        return d


class Gate(TypedDict, total=False):
    """The gate itself: where it sits in the run's history and what it cost."""

    schema_version: int
    """The record's schema version (absent in version 1 records)."""
    step: int
    """The training step (the record's key with ``branch``)."""
    log_step: int
    """The step trackers plot the gate at, when the framework logs at another step."""
    run_id: str
    """The run, constant across resumes."""
    branch: str
    """The training segment that wrote this gate (a new one at every start or resume)."""
    resume: bool
    """The first gate after a restart (a new baseline)."""
    trigger: str
    """Why the gate ran: ``start`` (the step-0 baseline), ``validation`` (after the framework's validation or
    evaluation), ``telemetry`` (an early gate the training-batch routing alarm asked for), or what a plain loop
    passed to ``AtlasGate.run``."""
    trigger_reason: str
    """An early gate: the alarm that asked for it; a scheduled gate while one was asked for: that it answers it."""
    loss_key: str | None
    """The metric the gate's ``loss`` was read from (None: no loss, as at an early gate between validations)."""
    objective_direction: str
    """How the gate's ``loss`` improves: ``minimize`` or ``maximize`` (a reward; ``objective.direction``). The loss
    trend, replay and the judge read each record in its own direction; a record without one is minimised."""
    kind: str
    """Evaluation gates only (``evaluations.jsonl``): validate | test."""
    num_experts: int | None
    """The most routed experts of any layer."""
    canary_fingerprint: str
    """sha256 of the canary's token ids and window layout: receipts compare only on the same canary."""
    canary_changed_from: str
    """A resume on another canary: the fingerprint it replaced."""
    handoff_reference: str | None
    """The declared healthy reference ``handoff_margin`` reads against (None: against the baseline)."""
    vocab_size: int | None
    """The model's vocabulary (with the canary NLL it tells a freshly initialised model)."""
    baseline_step: int | None
    """The step of the baseline the deltas are read against."""
    baseline_path: str
    """The baseline directory of this gate's reference."""
    protected_layers: list[int]
    """The protected set of this gate (``protected_layers: auto``, and any gate whose set changed)."""
    protected_source: str
    """``auto (chosen at step N from gates [...])`` (the run's choice, held), ``mid (no evidence yet: ...)``
    before it, or ``config: ...`` at a change under another setting."""
    protected_evidence_steps: list[int]
    """The gates the run's choice was made from."""
    protection: list[dict[str, Any]]
    """At the gate that chose the set, per layer: C2 loss, persistence, rank, chosen, reason."""
    protected_change: dict[str, Any]
    """The set changed at this gate (the choice replacing ``mid``, an adopted list, a configuration changed
    between resumes): from, to, step and why."""
    param_drift: dict[str, Any]
    """Parameter drift per module group against the baseline's parameters."""
    gate_seconds: Annotated[float, Metric()]
    """The gate's own wall time: what monitoring costs."""
    gate_share: Annotated[float, Metric()]
    """``gate_seconds`` over the wall time from the end of the previous gate's reading in this process to the end of
    this one's (the training between them, the previous gate's delivery and this gate): the share of that stretch
    the gate took, 0 to 1. Absent at a process's first gate, which has no stretch before it."""
    receipts_sha256: str
    """sha256 of the bytes of ``receipts/step_N.json`` or ``receipts/step_N.safetensors`` (rank zero adds it when it
    writes the receipts)."""
    rebuilt: str
    """Set on a gate whose line a crash cut short, rebuilt at the next resume from its whole receipts file: what
    the line still held and where the rest came from (its decision is re-derived by ``atlas-tracking replay``)."""
    retention: dict[str, Any]
    """The retention in force at this gate: ``keep_baselines``, ``keep_receipts`` and the pinned steps
    (docs/record.md#retention)."""
    pruned_baselines: list[str]
    """Baseline folders (relative to the run directory) retention removed after this gate was written."""
    pruned_receipts: list[str]
    """Receipts artifacts (relative to the run directory) retention removed after this gate (``gate.keep_receipts``)."""
    pruned_bytes: int
    """The bytes those removals free."""
    reference_pruned: str
    """A resume whose restored reference retention had removed: the folder and the gate that pruned it. The gate
    is a new baseline with no drift against that reference."""
    reference_fallback: str
    """The last baseline taken could not be written (a full disk): which one, the error, and the baseline on disk
    this gate measured against instead, or that none is and the next gate takes a new one
    (docs/record.md#a-full-disk)."""
    layers: list[LayerRecord]
    """One entry per routed layer, in forward order."""


class GateRecord(Gate, Summary, Cliff, Deltas, Margins, BaseDamage, CoMovement, total=False):
    """One line of ``gates.jsonl``: every section above, flat where the policy reads it, and the fields of
    :class:`GateDecision` (:data:`DECISION_FIELDS`)."""


class FailedGate(TypedDict, total=False):
    """One line of ``errors.jsonl``: a gate that could not run (NaN/Inf router logits, any exception inside the
    gate). The run's ground truth for failures, written before any tracker hears of it; the policy's state is
    kept, and the next gate that runs clears the failed state (docs/record.md#failed-gates-and-evaluations)."""

    step: int
    """The training step of the gate that could not run."""
    log_step: int
    """The step trackers plot the failure at, when the framework logs at another step."""
    error: str
    """The exception, as ``Type: message``."""
    failed_layers: list[str]
    """The routed layers the error names (NaN/Inf router logits), empty when it names none."""
    consecutive: int
    """Gates failed in a row up to this one (1 for the first)."""
    first_failed_step: int
    """The step of the first of those consecutive failed gates."""
    run_id: str
    """The run, constant across resumes."""
    branch: str
    """The training segment that tried the gate."""
    alerts: list[dict[str, Any]]
    """The alert the failure raised (ERROR)."""


# --- derived field lists -----------------------------------------------------------------------------


def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, vars(sys.modules[__name__]), include_extras=True)


def fields(cls: type) -> tuple[str, ...]:
    """The keys a section declares, in order.

    >>> fields(Margins)
    ('handoff_margin', 'refine_margin', 'handoff_layer', 'refine_layer', 'refine_margin_ci', 'refine_reference')
    """
    return tuple(_hints(cls))


def metric_fields(cls: type) -> dict[str, str]:
    """Field -> tracker name of every field of ``cls`` marked with :class:`Metric`.

    >>> metric_fields(Margins)
    {'handoff_margin': 'handoff_margin', 'refine_margin': 'refine_margin'}
    """
    out = {}
    for key, hint in _hints(cls).items():
        marks = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Metric)]
        if marks:
            out[key] = marks[0].name or key
    return out


SUMMARY_METRICS = tuple(metric_fields(Summary))
"""Cross-layer summaries logged at every gate (bounded: independent of depth)."""
METRIC_NAMES = {k: v for k, v in metric_fields(Summary).items() if k != v}
"""Tracker names of summaries whose unit is not the per-layer one (CV x 100 against a fraction)."""
LAYER_METRICS = tuple(metric_fields(LayerRecord))
"""Per-layer receipts logged at every gate (one key per routed layer each)."""
DRIFT_METRICS = (*metric_fields(Margins), *metric_fields(BaseDamage), *metric_fields(CoMovement))
GATE_METRICS = tuple(metric_fields(Gate))
"""The gate's own cost, logged at every gate."""
LAYER_FIELDS = (*fields(LayerReceipts), BOUNDARY_MASS_KEY)
"""Per-layer receipts a record copies from the receipts artifact."""
LAYER_DRIFT_FIELDS = fields(LayerDrift)
CLIFF_FIELDS = fields(Cliff)
BASE_DAMAGE_FIELDS = fields(BaseDamage)
COMOVE_FIELDS = fields(CoMovement)
DELTA_FIELDS = fields(Deltas)
DECISION_FIELDS = tuple(name for name in fields(GateDecision) if name != "step")
"""The record fields that hold the policy's decision."""
RECORD_FIELDS = (*fields(GateRecord), *DECISION_FIELDS)
"""Every top-level field a gate record may hold."""


FAILED = "FAILED"
"""The verdict of a run whose latest gate could not run (never a policy status: the policy did not read it)."""
ALERT_LEVELS = ("INFO", "WARN", "ERROR")
"""Alert levels, least severe first."""


def version_refused(version: Any, newest: int) -> str | None:
    """Why a file's ``schema_version`` is not one this package reads (an integer no newer than ``newest``), as the
    end of the reader's error; None when it reads it.

    >>> version_refused(3, 2), version_refused(2, 2)
    ('has schema_version 3; this atlas_tracking reads versions <= 2', None)
    """
    if isinstance(version, bool) or not isinstance(version, int) or version > newest:
        return f"has schema_version {version!r}; this atlas_tracking reads versions <= {newest}"
    return None


def upgrade_record(record: dict[str, Any]) -> dict[str, Any]:
    """A record as this version reads it: version 1 (unversioned) records gain ``schema_version``; a newer
    version than :data:`RECORD_SCHEMA_VERSION` is a :class:`RecordVersionError` naming both.

    >>> upgrade_record({"step": 3, "schema_version": 9})
    Traceback (most recent call last):
    ...
    atlas_tracking.schema.record.RecordVersionError: the record at step 3 has schema_version 9; this atlas_tracking reads versions <= 2
    """
    version = record.get("schema_version", 1)
    if (refused := version_refused(version, RECORD_SCHEMA_VERSION)) is not None:
        raise RecordVersionError(f"the record at step {record.get('step')} {refused}")
    if version == RECORD_SCHEMA_VERSION:
        return record
    return {"schema_version": RECORD_SCHEMA_VERSION, **record}
