"""The words of a post-training gate, each chosen by a rule that names the evidence it reads.

A gate's interpretation, its licensed and unlicensed claims and its action are sentences about its numbers, so each
is chosen by a :class:`Rule` over an :class:`Evidence`: the C2 trend, occupancy, the objective's trend (its name and
the direction it improves in), the canary NLL since the post-training base, the predicates and the stage. A rule says
nothing its inputs do not support: the objective "improved" only when its trend is ``improving`` and the base domain
is not damaged (the canary NLL not worse beyond ``policy.damage_nll_tol``, base damage not failing); a gate that
cannot read a trend says so; what to do comes from the stage, never from a sentence that would contradict it
(docs/policy.md#how-the-sentences-are-chosen). :func:`contradictions` is the check every sentence passes.

Example:
    >>> ev = Evidence(c2_trend="stable", occupancy="healthy", loss_trend="improving", canary="worse",
    ...               base_damage="fail", stage="clean", objective="loss", canary_delta=0.35)
    >>> interpretation(ev)[:72]
    'On the training data the loss fell, but the canary NLL rose +0.3500 sinc'
    >>> [c for c in licensed(ev) if "objective" in c]
    []
    >>> contradictions([interpretation(ev), *licensed(ev), action(ev)], ev)
    []
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from atlas_tracking.schema.record import Stage

NO_C2 = "n/a"
"""The C2 trend of a gate without C2 (top-1 routing)."""
C2_TRENDS = ("worsening", "stable", "improving", NO_C2)
OCCUPANCY = ("healthy", "degrading")
LOSS_TRENDS = ("improving", "stalling", "unknown")
CANARY = ("worse", "not worse", "unknown")
"""The canary NLL since the post-training base: ``worse`` beyond ``policy.damage_nll_tol`` with its CI excluding 0."""
PREDICATE_VERDICTS = ("pass", "at risk", "fail", "not measured")

ACTIONS = {
    Stage.baseline: "Wait for the first post-baseline gate: a baseline is a new reference point, not evidence of preservation.",
    Stage.clean: "Continue: objective and structural usage are jointly consistent with safe continuation on this horizon.",
    Stage.revoked: "Revoke any success or preservation claim. Keep the next gate on schedule and stop treating the run as "
    "healthy by default.",
    Stage.alert: "Do not clear the run. Require joint recovery of C2 and occupancy rather than a single encouraging rebound.",
    Stage.prepare: "Prepare intervention: the structural claim worsens again with the same occupancy pathology; passive "
    "continuation is on thin ice.",
    Stage.intervene: "Intervene or stop claiming progress: repeated degradation with the same occupancy pathology is no "
    "longer plausibly noise.",
    Stage.recovering: "Continue, but require repeated jointly recovering gates before declaring recovery.",
    Stage.forming: "Keep pretraining with gates on schedule: the atlas is still forming and handoff is not yet licensed.",
    Stage.ready: "Handoff is licensed on this canary: hand off when the objective is where you want it too (resume with "
    "policy.phase: post_training; the resume gate becomes the post-training baseline).",
    Stage.stable: "Keep pretraining, or declare a healthy reference (lifecycle.handoff_reference) to read readiness: "
    "the atlas is stable gate to gate, but stability alone does not license handoff.",
    Stage.collapse: "Restore balanced routing before spending more compute: routing has collapsed onto a few experts.",
}
"""Operator action per stage (docs/policy.md#actions-per-stage)."""

ESCALATION = {
    Stage.revoked: "Table 13 asks for two further worse gates before intervening: revoke claims now and collect the "
    "next gate.",
    Stage.alert: "Stay on alert; intervene only if two further gates are worse with the same occupancy pathology.",
    Stage.prepare: "Escalate: one further worse gate with the same occupancy pathology means intervene.",
    Stage.intervene: "Intervene or reset.",
}
"""What Table 11's bad rows ("Escalate.", "Intervene or reset.") mean at each stage of Table 13."""


@dataclass(frozen=True)
class Evidence:
    """What a post-training gate's sentences may read (each rule names the fields it uses)."""

    c2_trend: str
    occupancy: str
    loss_trend: str
    canary: str = "unknown"
    base_damage: str = "not measured"
    stage: str = Stage.clean.value
    objective: str = "loss"
    """What the sentences call the objective (``loss`` when minimised, the metric's name when maximised)."""
    direction: str = "minimize"
    protected_rewrite: str = "not measured"
    margin: bool = False
    """A State1 margin was measured at this gate."""
    canary_delta: float | None = None
    """The canary NLL now minus at the post-training base (the number the sentences quote)."""
    reasons: dict[str, str] = field(default_factory=dict)
    """The predicates' reasons, by name."""

    @property
    def damaged(self) -> bool:
        """The base domain is damaged at this gate: the canary NLL worse, or the base-damage predicate failing."""
        return self.canary == "worse" or self.base_damage == "fail"

    @property
    def moved(self) -> str:
        """The objective moving the way it improves: ``the loss fell`` or ``eval_reward rose``."""
        return f"{self._the} {'rose' if self.direction == 'maximize' else 'fell'}"

    @property
    def _the(self) -> str:
        return "the loss" if self.objective == "loss" else self.objective

    @property
    def failing(self) -> list[str]:
        """The predicates that fail at this gate."""
        return [name for name, verdict in (("base_damage", self.base_damage), ("protected_rewrite",
                                                                               self.protected_rewrite))
                if verdict == "fail"]


@dataclass(frozen=True)
class Rule:
    """One sentence rule: its name, the :class:`Evidence` fields it reads, when it applies and what it says."""

    name: str
    inputs: tuple[str, ...]
    when: Callable[[Evidence], bool]
    say: Callable[[Evidence], str]


def _structure(ev: Evidence) -> str:
    c2 = "no C2 (top-1 routing)" if ev.c2_trend == NO_C2 else f"C2 {ev.c2_trend}"
    usage = "expert usage narrowing" if ev.occupancy == "degrading" else "expert usage broad"
    return f"{c2}, {usage}"


def _escalation(ev: Evidence) -> str:
    text = ESCALATION.get(Stage(ev.stage)) if ev.stage in Stage._value2member_map_ else None
    return f" {text}" if text else ""


def _damage(ev: Evidence) -> str:
    """The base domain's damage in words: the canary NLL since the base and the predicate's verdict."""
    delta = ev.canary_delta
    nll = "" if delta is None else f" {'rose' if delta > 0 else 'moved'} {delta:+.4f} since the base"
    verdict = {"fail": "base damage fails", "at risk": "base damage at risk"}.get(ev.base_damage)
    return f"the canary NLL{nll}" + (f" ({verdict})" if verdict else "")


def _watch(ev: Evidence) -> str:
    """What a stalling gate asks for: the stage's escalation when it has one, else the next gate."""
    return _escalation(ev).strip() or "Watch the next gate before attributing the stall to the atlas."


_OK = ("stable", "improving")
INTERPRETATION_RULES = (
    Rule("top1_both_bad", ("c2_trend", "occupancy", "loss_trend", "objective", "stage"),
         lambda ev: ev.c2_trend == NO_C2 and ev.occupancy == "degrading" and ev.loss_trend == "stalling",
         lambda ev: f"Top-1 routing (no C2): occupancy and the objective are both bad: expert usage narrows and "
                    f"{ev._the} stalls.{_escalation(ev)}"),
    Rule("both_bad", ("c2_trend", "occupancy", "loss_trend", "objective", "stage"),
         lambda ev: ev.c2_trend == "worsening" and ev.occupancy == "degrading" and ev.loss_trend == "stalling",
         lambda ev: f"Both the scalar and structural stories are bad: C2 worsening, expert usage narrowing and "
                    f"{ev._the} stalling.{_escalation(ev)}"),
    Rule("objective_unread", ("loss_trend", "c2_trend", "occupancy", "objective"),
         lambda ev: ev.loss_trend == "unknown",
         lambda ev: f"No trend of {ev._the} yet (no earlier gate read in its direction since the baseline): the "
                    f"structure carries this gate's read ({_structure(ev)}).{_escalation(ev)}"),
    Rule("damaged_progress", ("loss_trend", "canary", "base_damage", "canary_delta", "c2_trend", "occupancy",
                              "objective", "direction"),
         lambda ev: ev.loss_trend == "improving" and ev.damaged,
         lambda ev: f"On the training data {ev.moved}, but {_damage(ev)}: the progress "
                    f"costs the base domain, and no objective claim is licensed ({_structure(ev)}).{_escalation(ev)}"),
    Rule("rewrite_progress", ("loss_trend", "protected_rewrite", "c2_trend", "occupancy", "objective", "direction",
                              "stage"),
         lambda ev: ev.loss_trend == "improving" and ev.protected_rewrite == "fail",
         lambda ev: f"On the training data {ev.moved} ({_structure(ev)}), but the protected-atlas rewrite "
                    "predicate fails: post-training is repurposing the protected layers, so the structural read does "
                    f"not clear the run.{_escalation(ev)}"),
    Rule("scalar_without_geometry", ("c2_trend", "occupancy", "loss_trend", "objective", "direction", "stage"),
         lambda ev: ev.c2_trend == "worsening" and ev.occupancy == "degrading" and ev.loss_trend == "improving",
         lambda ev: f"Scalar improvement without geometric recovery: {ev.moved} while C2 worsens and expert usage "
                    f"narrows. Objective progress is licensed; structural health is not.{_escalation(ev)}"),
    Rule("healthy_progress", ("c2_trend", "occupancy", "loss_trend", "objective", "direction"),
         lambda ev: ev.c2_trend in (*_OK, NO_C2) and ev.occupancy == "healthy" and ev.loss_trend == "improving",
         lambda ev: f"Objective improvement and structural usage are jointly consistent with safe continuation on "
                    f"the current horizon: {ev.moved}, {_structure(ev)}."),
    Rule("narrowing_progress", ("c2_trend", "occupancy", "loss_trend", "objective", "direction"),
         lambda ev: ev.c2_trend in (*_OK, NO_C2) and ev.occupancy == "degrading" and ev.loss_trend == "improving",
         lambda ev: f"Objective improves ({ev.moved}), but handoff or preservation claims are unlicensed because "
                    "expert usage is narrowing. Investigate."),
    Rule("motion", ("c2_trend", "occupancy", "loss_trend", "objective"),
         lambda ev: ev.c2_trend == "worsening" and ev.occupancy == "healthy",
         lambda ev: "Atlas motion is visible without occupancy collapse; the question is which layers are moving and "
                    "whether that motion is acceptable for the current stage."
                    + (f" Meanwhile {ev._the} stalls." if ev.loss_trend == "stalling" else f" Meanwhile {ev.moved}.")),
    Rule("stall", ("loss_trend", "c2_trend", "occupancy", "objective", "stage"),
         lambda ev: ev.loss_trend == "stalling",
         lambda ev: f"The objective ({ev.objective}) is stalling; structure is not failing on both axes "
                    f"({_structure(ev)}). {_watch(ev)}"),
)
"""Table 11's rows as rules, the first that applies wins (a rule never applies where an earlier one must)."""

TOP1_PREFIX = "Top-1 routing (no C2): occupancy, State1, drift and State3 carry the read. "


def _rule(rules: tuple[Rule, ...], ev: Evidence) -> Rule:
    return next(r for r in rules if r.when(ev))


def interpretation(ev: Evidence) -> str:
    """What the gate's pattern means (:data:`INTERPRETATION_RULES`; a top-1 gate says that C2 is absent)."""
    rule = _rule(INTERPRETATION_RULES, ev)
    text = rule.say(ev)
    if ev.c2_trend == NO_C2 and rule.name != "top1_both_bad":
        text = TOP1_PREFIX + text
    return text


LICENSED_RULES = (
    Rule("objective_improved", ("loss_trend", "canary", "base_damage", "objective"),
         lambda ev: ev.loss_trend == "improving" and not ev.damaged,
         lambda ev: f"The objective improved on the visited region ({ev.objective} / State3)."),
    Rule("occupancy", ("occupancy",), lambda ev: True,
         lambda ev: "The run is using a " + ("broad" if ev.occupancy == "healthy" else "narrowing")
                    + " subset of experts (occupancy)."),
    Rule("c2_worse", ("c2_trend",), lambda ev: ev.c2_trend == "worsening",
         lambda ev: "Adjacent co-active charts are becoming less compatible (State2)."),
    Rule("c2_better", ("c2_trend",), lambda ev: ev.c2_trend == "improving",
         lambda ev: "Adjacent co-active charts are becoming more compatible (State2)."),
    Rule("state1", ("margin",), lambda ev: ev.margin,
         lambda ev: "Top-k competitions are sharper / noisier near the boundary, as State1 shows (decisiveness only)."),
    Rule("scalar_without_geometry", ("c2_trend", "occupancy", "loss_trend", "canary", "base_damage", "objective"),
         lambda ev: ev.c2_trend == "worsening" and ev.occupancy == "degrading" and ev.loss_trend == "improving"
         and not ev.damaged,
         lambda ev: f"Scalar improvement without geometric recovery ({ev.objective} + State2 + occupancy read jointly)."),
    Rule("preservation_top1", ("stage", "c2_trend", "protected_rewrite"),
         lambda ev: ev.stage == Stage.clean and ev.c2_trend == NO_C2 and ev.protected_rewrite != "fail",
         lambda ev: "Preservation of the atlas's occupancy since the baseline on this canary (top-1 routing: there is "
                    "no State2 to read)."),
    Rule("preservation", ("stage", "c2_trend", "protected_rewrite"),
         lambda ev: ev.stage == Stage.clean and ev.c2_trend != NO_C2 and ev.protected_rewrite != "fail",
         lambda ev: "Preservation of the atlas since the baseline on this canary (State2 + occupancy jointly healthy)."),
)
"""The claims a post-training gate licenses (Table 4), every rule that applies."""

UNLICENSED_RULES = (
    Rule("margin_trap", (), lambda ev: True,
         lambda ev: "Global routed health from State1 margins alone (the margin trap)."),
    Rule("no_c2", ("c2_trend",), lambda ev: ev.c2_trend == NO_C2,
         lambda ev: "Co-active chart compatibility (State2): top-1 routing has no co-active pairs, so no C2."),
    Rule("objective_unread", ("loss_trend", "objective"), lambda ev: ev.loss_trend == "unknown",
         lambda ev: f"Any trend of {ev._the}: no earlier gate was read in its direction since the baseline."),
    Rule("damaged_progress", ("loss_trend", "canary", "base_damage", "objective"),
         lambda ev: ev.loss_trend == "improving" and ev.damaged,
         lambda ev: f"That the objective improved: on the training data {ev.moved}, but {_damage(ev)}."),
    Rule("not_preserved", ("stage",), lambda ev: ev.stage != Stage.clean,
         lambda ev: "Atlas preservation or structural health since the baseline."),
    Rule("rewritten", ("stage", "protected_rewrite"), lambda ev: ev.stage == Stage.clean and ev.protected_rewrite == "fail",
         lambda ev: "Preservation of the atlas: the protected-atlas rewrite predicate fails ("
                    + ev.reasons.get("protected_rewrite", "refinement margin < 0") + ")."),
    Rule("handoff", ("occupancy",), lambda ev: ev.occupancy == "degrading",
         lambda ev: "Handoff readiness: usage is narrowing."),
    Rule("narrowed_region", ("objective",), lambda ev: True,
         lambda ev: f"Whether progress came from a narrowed visited region, from {ev.objective} alone."),
    Rule("recovery", ("c2_trend", "occupancy", "stage"),
         lambda ev: ev.c2_trend != "worsening" and ev.occupancy == "healthy" and ev.stage != Stage.clean,
         lambda ev: "Recovery: it needs repeated jointly recovering gates."),
)
"""The claims a post-training gate does not license, every rule that applies."""

ACTION_RULES = (
    Rule("predicate_fails", ("stage", "base_damage", "protected_rewrite", "canary", "canary_delta"),
         lambda ev: ev.stage in (Stage.clean, Stage.recovering) and (bool(ev.failing) or ev.damaged),
         lambda ev: "Do not continue on the structural read alone: " + "; ".join(
             [f"{name} fails ({ev.reasons.get(name, 'fail')})" for name in ev.failing]
             + ([_damage(ev)] if ev.base_damage != "fail" and ev.damaged else []))
         + ". Compare the run with its base on the canary before going on (docs/policy.md#the-three-predicates)."),
    Rule("clean_without_progress", ("stage", "loss_trend", "objective"),
         lambda ev: ev.stage == Stage.clean and ev.loss_trend != "improving",
         lambda ev: f"Continue: C2 and occupancy are jointly consistent with safe continuation on this horizon; "
                    f"{ev._the} is {'stalling' if ev.loss_trend == 'stalling' else 'without a trend yet'}, which is "
                    "the objective's question, not the atlas's."),
    Rule("stage", ("stage",), lambda ev: True, lambda ev: ACTIONS[Stage(ev.stage)]),
)
"""What the operator should do: the stage's action (:data:`ACTIONS`), unless a predicate fails or the objective
does not move in a clean stage."""


def licensed(ev: Evidence) -> list[str]:
    """Every licensed claim whose rule applies (:data:`LICENSED_RULES`)."""
    return [r.say(ev) for r in LICENSED_RULES if r.when(ev)]


def unlicensed(ev: Evidence) -> list[str]:
    """Every unlicensed claim whose rule applies (:data:`UNLICENSED_RULES`)."""
    return [r.say(ev) for r in UNLICENSED_RULES if r.when(ev)]


def action(ev: Evidence) -> str:
    """The first action rule that applies (:data:`ACTION_RULES`)."""
    return _rule(ACTION_RULES, ev).say(ev)


_IMPROVES = re.compile(r"(?i)objective improv|objective progress is licensed|scalar improvement|"
                       r"objective and structural usage are jointly consistent")


def contradictions(sentences: list[str], ev: Evidence) -> list[str]:
    """The sentences (an interpretation, licensed claims, an action: never the unlicensed ones, which deny) that
    state something the evidence contradicts, each with why; empty when they all agree with it.

    >>> contradictions(["Objective improves, but usage is narrowing."],
    ...                Evidence(c2_trend="stable", occupancy="degrading", loss_trend="unknown"))
    ["'Objective improves, but usage is narrowing.': the objective's trend is unknown"]
    """
    out = []
    moved_wrong = f"{ev._the} {'fell' if ev.direction == 'maximize' else 'rose'}"

    def bad(text: str, why: str) -> None:
        out.append(f"{text!r}: {why}")

    for s in sentences:
        if _IMPROVES.search(s) or ev.moved.lower() in s.lower():
            if ev.loss_trend != "improving":
                bad(s, f"the objective's trend is {ev.loss_trend}")
            elif ev.damaged and "canary NLL" not in s:
                bad(s, f"the base domain is damaged (canary {ev.canary}, base damage {ev.base_damage})")
        if moved_wrong.lower() in s.lower():
            bad(s, f"{ev.objective} is {ev.direction}d: it improves the other way")
        if ev.objective != "loss" and re.search(r"(?i)\bthe loss\b", s):
            bad(s, f"the objective is {ev.objective}, not a loss")
        if re.search(r"(?i)\bstall", s) and ev.loss_trend != "stalling":
            bad(s, f"the objective's trend is {ev.loss_trend}, not stalling")
        if re.search(r"(?i)no trend|without a trend", s) and ev.loss_trend != "unknown":
            bad(s, f"the objective's trend is {ev.loss_trend}")
        if re.search(r"(?i)C2 worsen|less compatible", s) and ev.c2_trend != "worsening":
            bad(s, f"C2 is {ev.c2_trend}")
        if re.search(r"(?i)more compatible|C2 improving", s) and ev.c2_trend != "improving":
            bad(s, f"C2 is {ev.c2_trend}")
        if re.search(r"(?i)narrow", s) and ev.occupancy != "degrading" and "narrowed visited region" not in s:
            bad(s, "occupancy is healthy")
        if re.search(r"(?i)\bbroad\b|jointly healthy|jointly consistent", s) and ev.occupancy == "degrading":
            bad(s, "occupancy is degrading")
        if re.search(r"(?i)jointly consistent|jointly healthy", s) and ev.c2_trend == "worsening":
            bad(s, "C2 is worsening")
        if re.search(r"(?i)safe continuation|^continue", s) and (ev.failing or ev.stage in ESCALATION):
            bad(s, f"stage {ev.stage}, failing predicates {ev.failing or 'none'}")
        if re.search(r"(?i)watch the next gate", s) and ev.stage in (Stage.prepare, Stage.intervene):
            bad(s, f"the stage is {ev.stage}")
        if re.search(r"Intervene or", s) and ev.stage != Stage.intervene:
            bad(s, f"the stage is {ev.stage}, not intervene")
        if re.search(r"(?i)^Preservation of the atlas", s) and (ev.stage != Stage.clean or ev.protected_rewrite == "fail"):
            bad(s, f"stage {ev.stage}, protected-atlas rewrite {ev.protected_rewrite}")
    return out
