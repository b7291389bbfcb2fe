"""Gate reading: claim licensing and staged escalation (RECEIPTS.md, Gate reading; seeds/000 tables 4, 6, 11-14).

Pure logic on gate summaries: no model, no torch. A :class:`GatePolicy` reads each gate against
the baseline and the previous gate and returns a :class:`GateDecision`: a status (BASELINE,
GREEN, YELLOW, RED), a stage of the staged escalation (baseline, clean, revoked, alert,
prepare, intervene, recovering), the Table 11 interpretation, the Table 4 licensed and
unlicensed claims, the Table 14 first intervention, and the worst protected layers. Its state
is a plain dict, so decisions survive restarts.

Example (the paper's Distill-640, Table 3):
    >>> p = GatePolicy()
    >>> rows = [(0, .083, 42, 3.00, 140, None), (500, -.027, 285, 2.32, 190, 4.73),
    ...         (1000, -.020, 285, 2.32, 190, 4.53), (1500, -.042, 300, 2.25, 194, 4.48),
    ...         (2000, -.063, 300, 2.25, 205, 4.48)]
    >>> [(d.status, d.stage) for d in (p.read(GateSummary(*r)) for r in rows)]
    [('BASELINE', 'baseline'), ('YELLOW', 'revoked'), ('YELLOW', 'alert'), ('YELLOW', 'prepare'), ('YELLOW', 'intervene')]
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from atlas_tracking.config import AtlasConfig, PolicyConfig

STAGES = ("baseline", "clean", "recovering", "revoked", "alert", "prepare", "intervene")
BAD_STAGES = ("revoked", "alert", "prepare", "intervene")

ACTIONS = {
    "baseline": "Wait for the first post-baseline gate: a baseline is a new reference point, not evidence of preservation.",
    "clean": "Continue: objective and structural usage are jointly consistent with safe continuation on this horizon.",
    "revoked": "Revoke any success or preservation claim. Keep the next gate on schedule and stop treating the run as "
    "healthy by default.",
    "alert": "Do not clear the run. Require joint recovery of C2 and occupancy rather than a single encouraging rebound.",
    "prepare": "Prepare intervention: the structural claim worsens again with the same occupancy pathology; passive "
    "continuation is on thin ice.",
    "intervene": "Intervene or stop claiming progress: repeated degradation with the same occupancy pathology is no "
    "longer plausibly noise.",
    "recovering": "Continue, but require repeated jointly recovering gates before declaring recovery.",
}
"""Operator action per stage (seeds/000 Tables 6 and 13)."""

INTERPRETATIONS = {
    ("ok", "healthy", "improving"): "Objective improvement and structural usage are jointly consistent with safe "
    "continuation on the current horizon.",
    ("ok", "degrading", "improving"): "Objective improves, but handoff or preservation claims are unlicensed because "
    "usage is narrowing. Investigate.",
    ("worsening", "healthy", "improving"): "Atlas motion is visible without occupancy collapse; the question is which "
    "layers are moving and whether that motion is acceptable for the current stage.",
    ("worsening", "degrading", "improving"): "Scalar improvement without geometric recovery. Objective progress is "
    "licensed; structural health is not. Escalate.",
    ("worsening", "degrading", "stalling"): "Both the scalar and structural stories are bad. Intervene or reset.",
}
"""Table 11 rows keyed by (C2 trend, occupancy, loss)."""

INTERVENTIONS = {
    "overlap_and_occupancy": "Endpoint/adaptor regularization or router-prior control at matched scalar success. "
    "Do not keep training passively.",
    "atlas_drift": "Inspect protected layers first; tighten chart-preserving controls before changing the experts.",
    "resume": "Do nothing except collect the first valid post-baseline gate.",
    "boundary": "Check gain drift, thresholding, and boundary-local router behavior before escalating to broad "
    "intervention.",
    "repair": "Continue, but require repeated gates before declaring recovery.",
    "occupancy": "Investigate the narrowing of expert usage (router prior, load balance, data mix) before claiming "
    "handoff or preservation.",
}
"""Table 14: first intervention to try, by observed pattern."""


class PolicyInputError(ValueError):
    """A gate summary lacks a field or holds a non-numeric value."""


@dataclass
class GateSummary:
    """What the policy reads from one gate (mean_cv in the paper's unit: load CV x 100)."""

    step: int
    c2: float
    dead_experts: float
    min_entropy: float
    mean_cv: float
    loss: float | None = None
    margin: float | None = None
    resume: bool = False
    num_experts: int | None = None
    c2_delta_ci: tuple[float, float] | None = None
    dead_experts_delta_ci: tuple[float, float] | None = None
    min_entropy_delta_ci: tuple[float, float] | None = None
    mean_cv_delta_ci: tuple[float, float] | None = None
    layers: list[dict[str, Any]] = field(default_factory=list)

    REQUIRED = ("step", "c2", "dead_experts", "min_entropy", "mean_cv")
    CI_FIELDS = ("c2_delta_ci", "dead_experts_delta_ci", "min_entropy_delta_ci", "mean_cv_delta_ci")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GateSummary:
        """Validate and build; errors name the missing or non-numeric field."""
        if not isinstance(data, dict):
            raise PolicyInputError("a gate must be a JSON object")
        for key in cls.REQUIRED:
            if key not in data or data[key] is None:
                raise PolicyInputError(f"field '{key}' is missing")
        values: dict[str, Any] = {}
        for key in ("c2", "dead_experts", "min_entropy", "mean_cv", "loss", "margin"):
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
        num = data.get("num_experts")
        return cls(step=step, resume=resume, layers=layers, num_experts=int(num) if isinstance(num, int) else None,
                   **values, **cis)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in self.CI_FIELDS:
            d[key] = list(d[key]) if d[key] else None
        return d


@dataclass
class GateDecision:
    """The policy's reading of one gate."""

    step: int
    status: str
    stage: str
    c2_trend: str
    occupancy: str
    loss_trend: str
    action: str
    interpretation: str
    licensed: list[str]
    unlicensed: list[str]
    intervention: str | None
    worst_layers: list[dict[str, Any]] = field(default_factory=list)
    stage_before_resume: str | None = None
    alerts: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _trend_vs(now: float, ref: float, tol: float) -> str:
    if now < ref - tol:
        return "worsening"
    if now > ref + tol:
        return "improving"
    return "stable"


class GatePolicy:
    """Staged escalation over a sequence of gates (first gate, or a resume, is the baseline)."""

    def __init__(self, config: PolicyConfig | AtlasConfig | None = None):
        if isinstance(config, AtlasConfig):
            config = config.policy
        self.cfg = config or PolicyConfig()
        self.stage: str | None = None
        self.recover_count = 0
        self.baseline: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "recover_count": self.recover_count,
            "baseline": self.baseline,
            "history": [dict(h) for h in self.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stage = state.get("stage")
        self.recover_count = int(state.get("recover_count", 0))
        self.baseline = state.get("baseline")
        self.history = [dict(h) for h in state.get("history", [])]

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
        trend = _trend_vs(g.c2, ref["c2"], self.cfg.c2_tol)
        if self.cfg.use_ci and g.c2_delta_ci is not None:
            lo, hi = g.c2_delta_ci
            if trend == "worsening" and hi >= 0:
                return "stable"
            if trend == "improving" and lo <= 0:
                return "stable"
        return trend

    def _loss_trend(self, g: GateSummary) -> str:
        """Improving: below the loss ``loss_window`` gates back (by more than loss_tol) and not above the last one."""
        if g.loss is None:
            return "unknown"
        earlier = [h["loss"] for h in self.history[self._baseline_index():] if h.get("loss") is not None]
        if not earlier:
            return "unknown"
        window = self.cfg.loss_window
        ref = earlier[-window] if len(earlier) >= window else earlier[0]
        improving = g.loss < ref - self.cfg.loss_tol and g.loss <= earlier[-1] + self.cfg.loss_tol
        return "improving" if improving else "stalling"

    def _baseline_index(self) -> int:
        for i in range(len(self.history) - 1, -1, -1):
            if self.history[i]["status"] == "BASELINE":
                return i
        return 0

    def read(self, g: GateSummary) -> GateDecision:
        """Read one gate and advance the stage."""
        if self.baseline is None or g.resume:
            return self._new_baseline(g)
        ref, prev = self.baseline, self.history[-1]
        c2_trend = self._c2_trend(g, ref)
        occupancy = self._occupancy(g, ref)
        loss_trend = self._loss_trend(g)
        bad = c2_trend == "worsening" or occupancy == "degrading"
        if not bad:
            status = "GREEN"
        elif c2_trend == "worsening" and occupancy == "degrading" and loss_trend == "stalling":
            status = "RED"
        else:
            status = "YELLOW"
        rebound = g.c2 > prev["c2"] + self.cfg.c2_tol
        repaired = self._repaired(g, prev)
        joint_recovery = status == "GREEN" or (rebound and repaired)
        stage = self._next_stage(status, joint_recovery, rebound)
        decision = GateDecision(
            step=g.step, status=status, stage=stage, c2_trend=c2_trend, occupancy=occupancy, loss_trend=loss_trend,
            action=ACTIONS[stage], interpretation=_interpretation(c2_trend, occupancy, loss_trend),
            licensed=_licensed(g, c2_trend, occupancy, loss_trend, stage),
            unlicensed=_unlicensed(c2_trend, occupancy, stage),
            intervention=_intervention(c2_trend, occupancy, loss_trend, stage, rebound, repaired, g, prev),
            worst_layers=_worst_layers(g, ref),
        )
        self._remember(g, status, stage)
        return decision

    def _next_stage(self, status: str, joint_recovery: bool, rebound: bool) -> str:
        stage = self.stage
        if stage in ("baseline", "clean"):
            self.recover_count = 0
            return "clean" if status == "GREEN" else "revoked"
        if joint_recovery:
            self.recover_count += 1
            return "clean" if self.recover_count >= self.cfg.n_recover else "recovering"
        self.recover_count = 0
        if stage == "recovering":
            return "revoked"
        if stage == "revoked":
            return "alert" if rebound else "prepare"
        if stage == "alert":
            return "alert" if rebound else "prepare"
        if stage == "prepare":
            return "prepare" if rebound else "intervene"
        return "intervene"

    def _new_baseline(self, g: GateSummary) -> GateDecision:
        before = self.stage if g.resume else None
        self.baseline = {"step": g.step, "c2": g.c2, "dead_experts": g.dead_experts, "min_entropy": g.min_entropy,
                         "mean_cv": g.mean_cv, "loss": g.loss, "margin": g.margin,
                         "layers": [{k: lay.get(k) for k in ("name", "ordinal", "c2", "dead_experts")} for lay in g.layers]}
        self.recover_count = 0
        self._remember(g, "BASELINE", "baseline")
        licensed = ["This is the state of the atlas at this step (a new reference point)."]
        if g.resume:
            licensed.append("Operational recovery: the resumed run is measurable.")
        return GateDecision(
            step=g.step, status="BASELINE", stage="baseline", c2_trend="stable", occupancy="healthy",
            loss_trend="unknown", action=ACTIONS["baseline"],
            interpretation="New baseline: preservation is untested until the next gate.",
            licensed=licensed,
            unlicensed=["Any preservation claim about what happened after this baseline (untested until the next gate)."],
            intervention=INTERVENTIONS["resume"] if g.resume else None,
            stage_before_resume=before,
        )

    def _remember(self, g: GateSummary, status: str, stage: str) -> None:
        self.stage = stage
        self.history.append({"step": g.step, "status": status, "stage": stage, "c2": g.c2,
                             "dead_experts": g.dead_experts, "min_entropy": g.min_entropy, "mean_cv": g.mean_cv,
                             "loss": g.loss})


def _interpretation(c2_trend: str, occupancy: str, loss: str) -> str:
    c2_key = "worsening" if c2_trend == "worsening" else "ok"
    loss_key = "stalling" if loss == "stalling" else "improving"
    if (c2_key, occupancy, loss_key) in INTERPRETATIONS:
        return INTERPRETATIONS[(c2_key, occupancy, loss_key)]
    if loss_key == "stalling":
        return ("The objective is stalling; structure is not yet failing on both axes. Watch the next gate "
                "before attributing the stall to the atlas.")
    return INTERPRETATIONS[(c2_key, occupancy, "improving")]


def _licensed(g: GateSummary, c2_trend: str, occupancy: str, loss: str, stage: str) -> list[str]:
    out = []
    if loss == "improving":
        out.append("The objective improved on the visited region (loss / State3).")
    out.append("The run is using a " + ("broad" if occupancy == "healthy" else "narrowing") + " subset of experts (occupancy).")
    if c2_trend == "worsening":
        out.append("Adjacent co-active charts are becoming less compatible (State2).")
    elif c2_trend == "improving":
        out.append("Adjacent co-active charts are becoming more compatible (State2).")
    if g.margin is not None:
        out.append("Top-k competitions are sharper / noisier near the boundary, as State1 shows (decisiveness only).")
    if c2_trend == "worsening" and occupancy == "degrading" and loss == "improving":
        out.append("Scalar improvement without geometric recovery (loss + State2 + occupancy read jointly).")
    if stage == "clean":
        out.append("Preservation of the atlas since the baseline on this canary (State2 + occupancy jointly healthy).")
    return out


def _unlicensed(c2_trend: str, occupancy: str, stage: str) -> list[str]:
    out = ["Global routed health from State1 margins alone (the margin trap)."]
    if stage != "clean":
        out.append("Atlas preservation or structural health since the baseline.")
    if occupancy == "degrading":
        out.append("Handoff readiness: usage is narrowing.")
    out.append("Whether progress came from a narrowed visited region, from loss alone.")
    if c2_trend != "worsening" and occupancy == "healthy" and stage != "clean":
        out.append("Recovery: it needs repeated jointly recovering gates.")
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
    if g.margin is not None and prev.get("margin") is not None and g.margin < prev["margin"] and c2_trend == "stable":
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
