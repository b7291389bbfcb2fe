"""Gate reading: lifecycle phases, claim licensing and staged escalation.

docs/policy.md (the report's Tables 4, 6, 10, 11-14). Pure logic on
gate summaries: no model, no torch. A :class:`GatePolicy` reads each gate in its phase and
returns a :class:`GateDecision` that states the phase. In ``post_training`` a gate is read
against the baseline and the previous gate: a status (BASELINE, GREEN, YELLOW, RED), a stage of
the staged escalation (baseline, clean, revoked, alert, prepare, intervene, recovering), the
Table 11 interpretation, the Table 4 licensed and unlicensed claims, the Table 14 first
intervention, and the worst protected layers. In ``pretraining`` the reference rolls forward
gate to gate, escalation is off, and the stage is ``forming``, ``ready`` (handoff readiness,
Table 10) or ``collapse`` (occupancy collapse, YELLOW). Its state is a plain dict, so decisions
survive restarts.

Example (the paper's Distill-640, Table 3):
    >>> p = GatePolicy()
    >>> rows = [(0, .083, 42, 3.00, 140, None), (500, -.027, 285, 2.32, 190, 4.73),
    ...         (1000, -.020, 285, 2.32, 190, 4.53), (1500, -.042, 300, 2.25, 194, 4.48),
    ...         (2000, -.063, 300, 2.25, 205, 4.48)]
    >>> [(d.status.value, d.stage.value) for d in (p.read(GateSummary(*r)) for r in rows)]
    [('BASELINE', 'baseline'), ('YELLOW', 'revoked'), ('YELLOW', 'alert'), ('YELLOW', 'prepare'), ('YELLOW', 'intervene')]
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from atlas_tracking.decisions.phases import (
    PHASES,
    collapse_reasons,
    detect_phase,
    handoff_margin_reason,
    moved,
    readiness_floor,
    readiness_reasons,
    v2_c1_failures,
)
from atlas_tracking.decisions.predicates import INPUTS, read_predicates
from atlas_tracking.decisions.sentences import (
    ACTIONS,
    NO_C2,
    Evidence,
    action,
    interpretation,
    licensed,
    unlicensed,
)
from atlas_tracking.schema.config import DIRECTIONS, AtlasConfig, PolicyConfig
from atlas_tracking.schema.interventions import RECIPES
from atlas_tracking.schema.record import DELTA_FIELDS, GateDecision, Phase, Stage, Status

RULES = {
    "first_bad": "Table 13 row 1: first bad gate after a clean baseline",
    "rebound": "Table 13 row 2: one encouraging rebound without occupancy repair",
    "plateau": "Table 11 row 2: a persistent bad plateau (not worse, not repaired): investigate",
    "worse_once": "Table 13 row 3: a worse gate with the same occupancy pathology (the first of two)",
    "worse_twice": "Table 13 row 3: two subsequent worse gates with the same occupancy pathology",
    "motion": "Table 11 row 3: C2 motion without the same occupancy pathology never escalates on its own",
    "recovering": "Table 14 row 5: C2 and occupancy recovering jointly; repeated gates before declaring recovery",
    "recovered": "Table 14 row 5: repeated jointly recovering gates",
    "relapse": "Table 13 row 1: a bad gate during recovery revokes the claims again",
    "clean": "Table 11 row 1: C2 and occupancy jointly healthy",
    "resume": "Table 13 row 4: resume checkpoint with only a new baseline measurement",
    "baseline": "Table 13 row 4: a new baseline; wait for the first post-baseline gate",
    "pretraining": "Table 10 row 1: is pretraining done enough to hand off?",
}
"""The table row each stage transition follows (the record's ``rule``)."""

INTERVENTIONS = {name: recipe.action for name, recipe in RECIPES.items()}
"""Table 14: first intervention to try, by observed pattern."""


class PolicyInputError(ValueError):
    """A gate summary lacks a field or holds a non-numeric value."""


@dataclass
class GateSummary:
    """What the policy reads from one gate (mean_cv in the paper's unit: load CV x 100)."""

    step: int
    c2: float | None
    """None only with ``c2_absent`` (top-1 routing: no co-active pairs)."""
    dead_experts: float
    min_entropy: float
    mean_cv: float
    loss: float | None = None
    """The objective's value at the gate: a loss, or a maximised metric (``objective_direction``)."""
    margin: float | None = None
    resume: bool = False
    num_experts: int | None = None
    c2_protected: float | None = None
    canary_nll: float | None = None
    vocab_size: int | None = None
    handoff_margin: float | None = None
    handoff_reference: str | None = None
    """The declared healthy reference the handoff margin reads against (None: the baseline)."""
    phase: str | None = None
    """The phase a record states (replays honour it at baseline gates when policy.phase is auto)."""
    c2_delta_ci: tuple[float, float] | None = None
    dead_experts_delta_ci: tuple[float, float] | None = None
    min_entropy_delta_ci: tuple[float, float] | None = None
    mean_cv_delta_ci: tuple[float, float] | None = None
    layers: list[dict[str, Any]] = field(default_factory=list)
    damage: dict[str, Any] = field(default_factory=dict)
    """What the three predicates read (refinement margin and base damage since the base; :data:`INPUTS`)."""
    c2_absent: str | None = None
    """Why C2 is absent (the record's ``c2_absent``): the gate is read by the C2-free rules
    (docs/policy.md#top-1-routing)."""
    loss_key: str | None = None
    """The metric ``loss`` was read from (None: not named, as in a plain loop)."""
    objective_direction: str = "minimize"
    """How ``loss`` improves (the record's ``objective_direction``; records without one are minimised)."""

    REQUIRED = ("step", "c2", "dead_experts", "min_entropy", "mean_cv")
    CI_FIELDS = tuple(key for key in DELTA_FIELDS if key.endswith("_ci"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GateSummary:
        """Validate and build; errors name the missing or non-numeric field."""
        if not isinstance(data, dict):
            raise PolicyInputError("a gate must be a JSON object")
        absent = data.get("c2_absent")
        if absent is not None and not isinstance(absent, str):
            raise PolicyInputError(f"field 'c2_absent' must be a string, got {absent!r}")
        for key in cls.REQUIRED:
            if (key not in data or data[key] is None) and not (key == "c2" and absent):
                raise PolicyInputError(f"field '{key}' is missing")
        values: dict[str, Any] = {}
        for key in ("c2", "dead_experts", "min_entropy", "mean_cv", "loss", "margin", "c2_protected", "canary_nll",
                    "handoff_margin"):
            v = data.get(key)
            if v is None:
                values[key] = None
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
                raise PolicyInputError(f"field '{key}' must be a finite number, got {v!r}")
            values[key] = float(v)
        step = data["step"]
        if isinstance(step, bool) or not isinstance(step, int):
            raise PolicyInputError(f"field 'step' must be an integer, got {step!r}")
        resume = data.get("resume", False)
        if not isinstance(resume, bool):
            raise PolicyInputError(f"field 'resume' must be true or false, got {resume!r}")
        cis = {}
        for key in cls.CI_FIELDS:
            ci = data.get(key)
            if ci is None or (isinstance(ci, (list, tuple)) and None in ci):
                cis[key] = None
                continue
            if not (isinstance(ci, (list, tuple)) and len(ci) == 2 and all(isinstance(x, (int, float)) for x in ci)):
                raise PolicyInputError(f"field '{key}' must be [low, high], got {ci!r}")
            cis[key] = (float(ci[0]), float(ci[1]))
        layers = data.get("layers", [])
        if not isinstance(layers, list) or not all(isinstance(x, dict) for x in layers):
            raise PolicyInputError("field 'layers' must be a list of objects")
        num, vocab, phase = data.get("num_experts"), data.get("vocab_size"), data.get("phase")
        reference = data.get("handoff_reference")
        if reference is not None and not isinstance(reference, str):
            raise PolicyInputError(f"field 'handoff_reference' must be a string, got {reference!r}")
        if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 2):
            raise PolicyInputError(f"field 'vocab_size' must be an integer >= 2, got {vocab!r}")
        if phase is not None and phase not in PHASES:
            raise PolicyInputError(f"field 'phase' must be one of {', '.join(PHASES)}, got {phase!r}")
        direction, loss_key = data.get("objective_direction") or "minimize", data.get("loss_key")
        if direction not in DIRECTIONS:
            raise PolicyInputError(f"field 'objective_direction' must be one of {', '.join(DIRECTIONS)}, "
                                   f"got {direction!r}")
        if loss_key is not None and not isinstance(loss_key, str):
            raise PolicyInputError(f"field 'loss_key' must be a string, got {loss_key!r}")
        return cls(step=step, resume=resume, layers=layers, num_experts=int(num) if isinstance(num, int) else None,
                   vocab_size=vocab, phase=phase, handoff_reference=reference, c2_absent=absent or None,
                   loss_key=loss_key, objective_direction=direction,
                   damage={k: data[k] for k in INPUTS if data.get(k) is not None}, **values, **cis)

    @property
    def objective_word(self) -> str:
        """What the sentences call the gate's objective (:func:`objective_name`)."""
        return objective_name(self.objective_direction, self.loss_key)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in self.CI_FIELDS:
            d[key] = list(d[key]) if d[key] else None
        return d


def _trend_vs(now: float, ref: float, tol: float) -> str:
    if now < ref - tol:
        return "worsening"
    if now > ref + tol:
        return "improving"
    return "stable"


class GatePolicy:
    """Gates read in their lifecycle phase (first gate, or a resume, is a baseline)."""

    def __init__(self, config: PolicyConfig | AtlasConfig | None = None):
        if isinstance(config, AtlasConfig):
            config = config.policy
        self.cfg = config or PolicyConfig()
        self.stage: str | None = None
        self.recover_count = 0
        self.stable_count = 0
        self.margin_count = 0
        """Pretraining: consecutive gates with the handoff margin >= 0 against a declared reference."""
        self.phase: str | None = None
        self.phase_source = ""
        self.baseline: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "recover_count": self.recover_count,
            "stable_count": self.stable_count,
            "margin_count": self.margin_count,
            "phase": self.phase,
            "phase_source": self.phase_source,
            "baseline": self.baseline,
            "history": [dict(h) for h in self.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stage = state.get("stage")
        self.recover_count = int(state.get("recover_count", 0))
        self.stable_count = int(state.get("stable_count", 0))
        self.margin_count = int(state.get("margin_count", 0))
        self.phase = state.get("phase")
        self.phase_source = state.get("phase_source", "")
        self.baseline = state.get("baseline")
        self.history = [dict(h) for h in state.get("history", [])]

    # --- phase -------------------------------------------------------------------------------
    def _configured_phase(self) -> str | None:
        return None if self.cfg.phase == "auto" else self.cfg.phase

    @property
    def rolls_reference(self) -> bool:
        """True when the next gate will be read in pretraining, against the gate before it.

        The gate runner then keeps the next gate's anchors and makes it the reference, so that
        drift and paired CIs are gate-to-gate.
        """
        return (self._configured_phase() or self.phase) == Phase.pretraining

    def _phase_for_baseline(self, g: GateSummary) -> tuple[str, str]:
        if g.phase is not None:
            return g.phase, "as recorded by the run"
        configured = self._configured_phase()
        if configured is not None:
            return configured, "config: policy.phase"
        if self.phase is not None:
            return self.phase, self.phase_source
        return detect_phase(g.canary_nll, g.vocab_size, self.cfg.fresh_nll_ratio)

    # --- reading -----------------------------------------------------------------------------
    def _occupancy(self, g: GateSummary, ref: dict[str, Any]) -> str:
        """Degrading when a proxy moved the bad way beyond tolerance (and, with paired CIs, the CI excludes 0)."""
        c = self.cfg
        use = c.use_ci
        dead = g.dead_experts > ref["dead_experts"] + c.dead_tol and not (
            use and g.dead_experts_delta_ci is not None and g.dead_experts_delta_ci[0] <= 0)
        entropy = g.min_entropy < ref["min_entropy"] - c.entropy_tol and not (
            use and g.min_entropy_delta_ci is not None and g.min_entropy_delta_ci[1] >= 0)
        cv = g.mean_cv > ref["mean_cv"] + c.cv_tol and not (
            use and g.mean_cv_delta_ci is not None and g.mean_cv_delta_ci[0] <= 0)
        return "degrading" if (dead or entropy or cv) else "healthy"

    def _repaired(self, g: GateSummary, prev: dict[str, Any]) -> bool:
        """Occupancy repair vs the previous gate: every proxy better beyond tolerance (none worse)."""
        c = self.cfg
        return (
            g.dead_experts < prev["dead_experts"] - c.dead_tol
            and g.min_entropy > prev["min_entropy"] + c.entropy_tol
            and g.mean_cv < prev["mean_cv"] - c.cv_tol
        )

    def _c2_trend(self, g: GateSummary, ref: dict[str, Any]) -> str:
        """worsening | stable | improving against ``ref``; ``n/a`` when either side has no C2 (top-1 routing)."""
        if g.c2 is None or ref.get("c2") is None:
            return NO_C2
        trend = _trend_vs(g.c2, ref["c2"], self.cfg.c2_tol)
        if self.cfg.use_ci and g.c2_delta_ci is not None:
            lo, hi = g.c2_delta_ci
            if trend == "worsening" and hi >= 0:
                return "stable"
            if trend == "improving" and lo <= 0:
                return "stable"
        return trend

    def _loss_trend(self, g: GateSummary) -> str:
        """Improving: better, in the objective's direction, than its value ``loss_window`` gates back (by more than
        loss_tol) and not worse than the last one (by more than loss_tol). Only earlier gates read in the same
        direction since the baseline count.

        >>> p = GatePolicy()
        >>> rewards = [GateSummary(s, 0.1, 0, 3.0, 100, loss=r, objective_direction="maximize")
        ...            for s, r in [(0, None), (10, 0.14), (20, 0.31)]]
        >>> [p.read(g).loss_trend for g in rewards]
        ['unknown', 'unknown', 'improving']
        """
        if g.loss is None:
            return "unknown"
        sign = cost_sign(g.objective_direction)  # the objective as a cost: lower is better in either direction
        earlier = [sign * h["loss"] for h in self.history[self._baseline_index():]
                   if h.get("loss") is not None and h.get("objective_direction", "minimize") == g.objective_direction]
        if not earlier:
            return "unknown"
        window = self.cfg.loss_window
        ref = earlier[-window] if len(earlier) >= window else earlier[0]
        cost = sign * g.loss
        improving = cost < ref - self.cfg.loss_tol and cost <= earlier[-1] + self.cfg.loss_tol
        return "improving" if improving else "stalling"

    def _baseline_index(self) -> int:
        for i in range(len(self.history) - 1, -1, -1):
            if self.history[i]["status"] == Status.BASELINE:
                return i
        return 0

    def read(self, g: GateSummary) -> GateDecision:
        """Read one gate and advance the stage.

        A gate is read in the phase its record states (a replayed or caught-up record), else in the
        configured phase; a change of phase makes the gate a new baseline.
        """
        wanted = g.phase or self._configured_phase()
        if self.baseline is None or g.resume or (wanted is not None and wanted != self.phase):
            return self._new_baseline(g)
        if self.phase == Phase.pretraining:
            return self._read_pretraining(g)
        ref, prev = self.baseline, self.history[-1]
        c2_trend = self._c2_trend(g, ref)
        occupancy = self._occupancy(g, ref)
        loss_trend = self._loss_trend(g)
        bad = c2_trend == "worsening" or occupancy == "degrading"
        structural = c2_trend in ("worsening", NO_C2)  # without C2, occupancy alone carries the structural read
        if not bad:
            status = Status.GREEN
        elif structural and occupancy == "degrading" and loss_trend == "stalling":
            status = Status.RED
        else:
            status = Status.YELLOW
        rebound = g.c2 is not None and prev.get("c2") is not None and g.c2 > prev["c2"] + self.cfg.c2_tol
        repaired = self._repaired(g, prev)
        joint_recovery = status == Status.GREEN or (repaired and (rebound or c2_trend == NO_C2))
        # Table 13: "the same occupancy pathology" is occupancy degrading at this gate and the one before;
        # C2 worsening with healthy occupancy (Table 11, third row) never escalates on its own.
        same_pathology = occupancy == "degrading" and prev.get("occupancy", occupancy) == "degrading"
        stage, rule = self._next_stage(status, joint_recovery, rebound, self._worse(g, prev), same_pathology)
        predicates = read_predicates(g.damage, self.cfg)
        ev = self._evidence(g, c2_trend, occupancy, loss_trend, stage, predicates)
        decision = GateDecision(
            step=g.step, status=status, stage=stage, c2_trend=c2_trend, occupancy=occupancy, loss_trend=loss_trend,
            action=action(ev), interpretation=interpretation(ev), licensed=licensed(ev), unlicensed=unlicensed(ev),
            intervention=_intervention(c2_trend, occupancy, loss_trend, stage, rebound, repaired, g, prev),
            worst_layers=_worst_layers(g, ref), phase=Phase.post_training, phase_source=self.phase_source,
            rule=RULES[rule], predicates=predicates,
        )
        self._remember(g, status, stage, occupancy)
        return decision

    def _evidence(self, g: GateSummary, c2_trend: str, occupancy: str, loss_trend: str, stage: Stage,
                  predicates: dict[str, dict[str, Any]]) -> Evidence:
        """What the gate's sentences read (:mod:`atlas_tracking.decisions.sentences`): the trends, the stage, the
        predicates and the canary NLL since the base (``worse`` beyond ``damage_nll_tol`` with its CI above 0)."""
        delta, ci = g.damage.get("canary_nll_delta_cumulative"), g.damage.get("canary_nll_delta_cumulative_ci")
        if delta is None:
            canary = "unknown"
        else:
            sure = not self.cfg.use_ci or not ci or None in ci or ci[0] > 0
            canary = "worse" if delta > self.cfg.damage_nll_tol and sure else "not worse"
        return Evidence(c2_trend=c2_trend, occupancy=occupancy, loss_trend=loss_trend, canary=canary,
                        base_damage=predicates["base_damage"]["verdict"], stage=Stage(stage).value,
                        objective=g.objective_word, direction=g.objective_direction,
                        protected_rewrite=predicates["protected_rewrite"]["verdict"], margin=g.margin is not None,
                        canary_delta=delta, reasons={k: v.get("reason", "") for k, v in predicates.items()})

    def _worse(self, g: GateSummary, prev: dict[str, Any]) -> list[str]:
        """What makes this gate worse than the previous one (empty: not worse): C2 below the previous gate's by
        more than ``c2_tol``, or an occupancy proxy worse than the previous gate's by more than its tolerance.

        >>> p = GatePolicy()
        >>> prev = {"c2": -0.020, "dead_experts": 285, "min_entropy": 2.32, "mean_cv": 190}
        >>> p._worse(GateSummary(1500, -0.042, 300, 2.25, 194), prev)
        ['C2 -0.0200 -> -0.0420', 'dead experts 285 -> 300', 'min entropy 2.320 -> 2.250']
        >>> p._worse(GateSummary(1500, -0.022, 285, 2.32, 190), prev)
        []
        """
        c = self.cfg
        out = []
        if g.c2 is not None and prev.get("c2") is not None and g.c2 < prev["c2"] - c.c2_tol:
            out.append(f"C2 {prev['c2']:+.4f} -> {g.c2:+.4f}")
        if g.dead_experts > prev["dead_experts"] + c.dead_tol:
            out.append(f"dead experts {prev['dead_experts']:g} -> {g.dead_experts:g}")
        if g.min_entropy < prev["min_entropy"] - c.entropy_tol:
            out.append(f"min entropy {prev['min_entropy']:.3f} -> {g.min_entropy:.3f}")
        if g.mean_cv > prev["mean_cv"] + c.cv_tol:
            out.append(f"mean CV {prev['mean_cv']:.1f} -> {g.mean_cv:.1f}")
        return out

    def _next_stage(self, status: Status, joint_recovery: bool, rebound: bool, worse: list[str],
                    same_pathology: bool) -> tuple[Stage, str]:
        """The next stage of Table 13 and the key of the rule (:data:`RULES`) that moved it."""
        stage = Stage(self.stage)
        if stage in (Stage.baseline, Stage.clean):
            self.recover_count = 0
            return (Stage.clean, "clean") if status == Status.GREEN else (Stage.revoked, "first_bad")
        if joint_recovery:
            self.recover_count += 1
            if self.recover_count >= self.cfg.n_recover:
                return Stage.clean, "recovered"
            return Stage.recovering, "recovering"
        self.recover_count = 0
        if stage == Stage.recovering:
            return Stage.revoked, "relapse"
        if stage == Stage.intervene:
            return Stage.intervene, "worse_twice"
        if rebound:
            return (stage if stage == Stage.prepare else Stage.alert), "rebound"
        if worse and same_pathology:
            return (Stage.intervene, "worse_twice") if stage == Stage.prepare else (Stage.prepare, "worse_once")
        if same_pathology:
            return (stage if stage == Stage.prepare else Stage.alert), "plateau"
        return stage, "motion"

    def _read_pretraining(self, g: GateSummary) -> GateDecision:
        """Table 10's first question against the previous gate: is the atlas stable, broad and not fragile?"""
        c, ref = self.cfg, self.baseline
        assert ref is not None
        c2_trend = self._c2_trend(g, ref)
        occupancy = self._occupancy(g, ref)
        loss_trend = self._loss_trend(g)
        moved_now = [name for name, delta, ci, tol in (
            *((("C2", g.c2 - ref["c2"], g.c2_delta_ci, c.c2_tol),) if c2_trend != NO_C2 else ()),
            ("dead experts", g.dead_experts - ref["dead_experts"], g.dead_experts_delta_ci, c.dead_tol),
            ("min entropy", g.min_entropy - ref["min_entropy"], g.min_entropy_delta_ci, c.entropy_tol),
            ("mean CV", g.mean_cv - ref["mean_cv"], g.mean_cv_delta_ci, c.cv_tol),
        ) if moved(delta, ci, tol, c.use_ci)]
        self.stable_count = 0 if moved_now else self.stable_count + 1
        collapse = collapse_reasons(g.layers, c.collapse_dead_fraction, c.collapse_effective_experts)
        falling = None
        ref_protected = _protected_c2(ref, g.layers)
        if g.c2_protected is not None and ref_protected is not None:
            if g.c2_protected < ref_protected - c.c2_tol:
                falling = (f"C2 falling on the protected layers: {ref_protected:.4f} -> {g.c2_protected:.4f} "
                           f"since step {ref['step']}")
        elif c2_trend == "worsening":
            falling = f"C2 falling since step {ref['step']} ({g.c2 - ref['c2']:+.4f})"
        reasons = readiness_reasons(stable_gates=self.stable_count, n_stable=c.n_stable, moved_now=moved_now,
                                    ref_step=ref["step"], collapse=collapse, c2_falling=falling,
                                    v2_failing=v2_c1_failures(g.layers),
                                    below_floor=readiness_floor(g.layers, c.ready_dead_fraction,
                                                                c.ready_effective_fraction))
        declared = g.handoff_reference is not None
        inside = declared and g.handoff_margin is not None and g.handoff_margin >= 0
        self.margin_count = self.margin_count + 1 if inside else 0
        margin_reason = handoff_margin_reason(g.handoff_reference, g.handoff_margin, self.margin_count, c.n_stable)
        if collapse:
            stage = Stage.collapse
        elif reasons:
            stage = Stage.forming
        elif margin_reason is None:
            stage = Stage.ready
        else:
            stage = Stage.stable if not declared else Stage.forming
        reasons += [margin_reason] if margin_reason else []
        status = Status.YELLOW if collapse else Status.GREEN
        handoff = {"ready": not reasons, "stable_gates": self.stable_count, "n_stable": c.n_stable,
                   "margin": g.handoff_margin, "margin_gates": self.margin_count,
                   "reference": g.handoff_reference, "basis": _readiness_basis(g.handoff_reference, c.n_stable),
                   "reference_step": ref["step"], "reasons": reasons}
        if c2_trend == NO_C2:
            handoff["basis"] += "; stability read from occupancy only (top-1 routing: no C2)"
        decision = GateDecision(
            step=g.step, status=status, stage=stage, c2_trend=c2_trend, occupancy=occupancy, loss_trend=loss_trend,
            action=ACTIONS[stage], interpretation=_pretraining_interpretation(stage, collapse, c.n_stable),
            licensed=_pretraining_licensed(g, loss_trend, stage),
            unlicensed=_pretraining_unlicensed(reasons),
            intervention=INTERVENTIONS["collapse"] if collapse else None,
            worst_layers=_worst_layers(g, ref), phase=Phase.pretraining, phase_source=self.phase_source,
            handoff=handoff, collapse=collapse, rule=RULES["pretraining"],
        )
        self.baseline = _reference(g)
        self._remember(g, status, stage, occupancy)
        return decision

    def _new_baseline(self, g: GateSummary) -> GateDecision:
        before = self.stage if g.resume else None
        phase_before = self.phase
        phase, self.phase_source = self._phase_for_baseline(g)
        self.phase = _plain(phase)
        self.baseline = _reference(g)
        self.recover_count = 0
        self.stable_count = 0
        self._remember(g, Status.BASELINE, Stage.baseline, "healthy")
        licensed = ["This is the state of the atlas at this step (a new reference point)."]
        if g.resume:
            licensed.append("Operational recovery: the resumed run is measurable.")
        self.margin_count = 0
        handoff = None
        if self.phase == Phase.pretraining:
            handoff = {"ready": False, "stable_gates": 0, "n_stable": self.cfg.n_stable, "margin": None,
                       "margin_gates": 0, "reference": g.handoff_reference,
                       "basis": _readiness_basis(g.handoff_reference, self.cfg.n_stable), "reference_step": None,
                       "reasons": ["a new reference: no earlier gate to compare with yet"]}
        return GateDecision(
            step=g.step, status=Status.BASELINE, stage=Stage.baseline,
            c2_trend=NO_C2 if g.c2 is None else "stable", occupancy="healthy",
            loss_trend="unknown", action=ACTIONS[Stage.baseline],
            interpretation="New baseline: preservation is untested until the next gate." if self.phase == Phase.post_training
            else "New reference in pretraining: the atlas is forming; the next gate is compared with this one.",
            licensed=licensed,
            unlicensed=["Any preservation claim about what happened after this baseline (untested until the next gate)."],
            intervention=INTERVENTIONS["resume"] if g.resume else None,
            stage_before_resume=before, phase=self.phase, phase_source=self.phase_source,
            phase_before_resume=phase_before if phase_before not in (None, self.phase) else None, handoff=handoff,
            rule=RULES["resume" if g.resume else "baseline"],
        )

    def _remember(self, g: GateSummary, status: Status, stage: Stage, occupancy: str) -> None:
        self.stage = Stage(stage).value  # the state holds plain strings: it is saved in checkpoints
        self.history.append({"step": g.step, "status": Status(status).value, "stage": self.stage, "c2": g.c2,
                             "dead_experts": g.dead_experts, "min_entropy": g.min_entropy, "mean_cv": g.mean_cv,
                             "loss": g.loss, "objective_direction": g.objective_direction, "occupancy": occupancy,
                             "phase": _plain(self.phase)})


def cost_sign(direction: str) -> int:
    """The factor that turns an objective into a cost, lower being better: 1 when minimised, -1 when maximised."""
    return -1 if direction == "maximize" else 1


def objective_name(direction: str, metric: str | None) -> str:
    """What the sentences call the objective: "loss" when minimised, the metric's name when maximised.

    >>> objective_name("minimize", "eval_loss"), objective_name("maximize", "eval_reward")
    ('loss', 'eval_reward')
    """
    if direction == "maximize":
        return metric or "the maximised objective"
    return "loss"


def _plain(value: str | None) -> str | None:
    """An enum member as its plain string (the policy's state is saved in checkpoints and JSON)."""
    return None if value is None else str(value)


def _reference(g: GateSummary) -> dict[str, Any]:
    """What later gates are read against: the summaries and the per-layer C2 of one gate."""
    return {"step": g.step, "c2": g.c2, "dead_experts": g.dead_experts, "min_entropy": g.min_entropy,
            "mean_cv": g.mean_cv, "loss": g.loss, "margin": g.margin, "c2_protected": g.c2_protected,
            "layers": [{k: lay.get(k) for k in ("name", "ordinal", "c2", "dead_experts", "protected")}
                       for lay in g.layers]}


def _protected_c2(ref: dict[str, Any], layers: list[dict[str, Any]]) -> float | None:
    """The reference's mean C2 over the layers protected at this gate: its own ``c2_protected`` when both gates
    protect the same layers; when the set changed between them (``protected_layers: auto``), the mean of its
    per-layer C2 over this gate's set, so both sides of the comparison hold the same layers.

    >>> ref = {"c2_protected": 0.1, "layers": [{"ordinal": 0, "c2": 0.1, "protected": True},
    ...                                        {"ordinal": 1, "c2": 0.3, "protected": False}]}
    >>> _protected_c2(ref, [{"ordinal": 0, "protected": True}, {"ordinal": 1, "protected": False}])
    0.1
    >>> _protected_c2(ref, [{"ordinal": 0, "protected": False}, {"ordinal": 1, "protected": True}])
    0.3
    """
    now = {lay.get("ordinal") for lay in layers if lay.get("protected")}
    before = {lay.get("ordinal") for lay in ref.get("layers") or [] if lay.get("protected")}
    by_ordinal = {lay.get("ordinal"): lay.get("c2") for lay in ref.get("layers") or []}
    values = [by_ordinal.get(i) for i in now]
    if not now or now == before or None in now or any(v is None or not math.isfinite(v) for v in values):
        return ref.get("c2_protected")
    return float(sum(values) / len(values))


def _readiness_basis(reference: str | None, n: int) -> str:
    """What a pretraining gate's readiness verdict rests on (docs/policy.md#handoff-readiness)."""
    if reference is None:
        return "stability only (no healthy reference declared)"
    return f"handoff margin >= 0 against the declared reference {reference} at {n} consecutive gates, with stability"


def _pretraining_interpretation(stage: str, collapse: list[str], n_stable: int) -> str:
    if stage == Stage.collapse:
        return ("Occupancy collapse during pretraining (" + "; ".join(collapse) + "): routing concentrates on a few "
                "experts, and an atlas cannot form around dead experts.")
    if stage == Stage.ready:
        return (f"Stable baseline for {n_stable} gates, healthy occupancy, protected-layer overlaps that are not "
                "fragile, and the handoff margin inside the boundary against the declared healthy reference: "
                "Table 10's handoff criteria hold on this canary.")
    if stage == Stage.stable:
        return (f"Stable for {n_stable} gates with healthy occupancy, but readiness rests on stability only (no "
                "healthy reference declared): the handoff margin has nothing healthy to read against, so handoff "
                "is not licensed.")
    return ("The atlas is forming: each gate is read against the previous one; preservation verdicts and escalation "
            "are off in pretraining, and the question is whether handoff is licensed yet.")


def _pretraining_licensed(g: GateSummary, loss: str, stage: str) -> list[str]:
    out = []
    if loss == "improving":
        out.append(f"The objective improved on the visited region ({g.objective_word} / State3).")
    if stage != Stage.collapse:
        out.append("No occupancy collapse: every routed layer stays above the collapse floors (occupancy).")
    if stage == Stage.ready:
        out.append("Handoff readiness on this canary (Table 10): stable atlas, healthy occupancy, protected-layer "
                   "overlaps not fragile, handoff margin >= 0 against the declared healthy reference.")
    return out


def _pretraining_unlicensed(reasons: list[str]) -> list[str]:
    out = ["Preservation of the atlas: in pretraining there is nothing to preserve yet (the reference rolls forward).",
           "Global routed health from State1 margins alone (the margin trap)."]
    if reasons:
        out.append("Handoff readiness: " + "; ".join(reasons) + ".")
    return out


def _intervention(c2_trend: str, occupancy: str, loss: str, stage: str, rebound: bool, repaired: bool,
                  g: GateSummary, prev: dict[str, Any]) -> str | None:
    if c2_trend == "worsening" and occupancy == "degrading":
        return INTERVENTIONS["overlap_and_occupancy"]
    if c2_trend == "worsening":
        return INTERVENTIONS["atlas_drift"]
    if rebound and repaired:
        return INTERVENTIONS["repair"]
    if occupancy == "degrading":
        return INTERVENTIONS["occupancy"]
    if (g.margin is not None and prev.get("margin") is not None and g.margin < prev["margin"]
            and c2_trend in ("stable", NO_C2)):
        return INTERVENTIONS["boundary"]
    return None


def _worst_layers(g: GateSummary, ref: dict[str, Any]) -> list[dict[str, Any]]:
    base = {lay.get("name"): lay for lay in ref.get("layers", [])}
    rows = []
    for lay in g.layers:
        if not lay.get("protected", True) or lay.get("c2") is None:
            continue
        b = base.get(lay.get("name"))
        delta = lay.get("c2_delta")
        if delta is None and b is not None and b.get("c2") is not None:
            delta = lay["c2"] - b["c2"]
        if delta is not None:
            rows.append({"name": lay.get("name"), "c2": lay["c2"], "c2_delta": delta})
    return sorted(rows, key=lambda r: r["c2_delta"])[:3]
