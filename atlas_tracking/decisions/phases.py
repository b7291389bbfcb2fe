"""Lifecycle phases (docs/policy.md#lifecycle-phases; the report's Table 10).

A gate is read in ``pretraining`` (the atlas is forming: is it done enough to hand off?) or in
``post_training`` (is the atlas preserved since the baseline?). This module holds the pieces of
the pretraining reading that the policy composes: which phase a run is in, which receipts moved
between two consecutive gates, occupancy collapse, and the handoff-readiness verdict with the
reasons that fail. Pure logic on gate summaries; :func:`model_vocab_size` only reads attributes.

Example (a random-init byte model's first gate, then a trained one):
    >>> str(detect_phase(5.56, 256, 0.9)[0]), str(detect_phase(1.38, 256, 0.9)[0])
    ('pretraining', 'post_training')
    >>> layers = [{"name": "l1", "num_experts": 32, "top_k": 2, "dead_experts": 28, "router_entropy": 0.9}]
    >>> collapse_reasons(layers, dead_fraction=0.5, effective_experts=2.0)
    ['l1: 28 of 32 experts dead (more than 0.5 of them)', 'l1: effective experts exp(H) = 2.46 < 2 x top-k 2']
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from atlas_tracking.schema.record import Phase

PHASES = tuple(phase.value for phase in Phase)


def model_vocab_size(model: Any) -> int | None:
    """The vocabulary size of a model or of the first submodule (or its ``config``) that states one."""
    modules = model.modules() if hasattr(model, "modules") else [model]
    for sub in modules:
        for holder in (getattr(sub, "config", None), sub):
            v = getattr(holder, "vocab_size", None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 1:
                return v
    return None


def detect_phase(canary_nll: float | None, vocab_size: int | None, ratio: float) -> tuple[Phase, str]:
    """Phase of a run from its first gate, and why.

    A freshly initialised language model predicts about uniformly, so its canary NLL is near
    ln(vocab_size); any trained model is far below (a byte model that has only learnt letter
    frequencies is already near 0.5 ln 256). ``ratio`` sets the line between the two.
    """
    if canary_nll is None or vocab_size is None or vocab_size < 2:
        return Phase.post_training, ("default: the first gate has no canary NLL and vocabulary size to recognise a "
                                 "freshly initialised model")
    line = ratio * math.log(vocab_size)
    if canary_nll >= line:
        return Phase.pretraining, (f"detected at the first gate: canary NLL {canary_nll:.3f} >= {ratio:g} x ln({vocab_size})"
                               f" = {line:.3f} (a freshly initialised model)")
    return Phase.post_training, (f"detected at the first gate: canary NLL {canary_nll:.3f} < {ratio:g} x ln({vocab_size}) "
                             f"= {line:.3f} (a trained model)")


def moved(delta: float, ci: Sequence[float] | None, tol: float, use_ci: bool) -> bool:
    """A change beyond tolerance whose paired CI (when used and present) excludes 0.

    >>> moved(0.02, [0.01, 0.03], 0.01, True), moved(0.02, [-0.01, 0.05], 0.01, True), moved(0.005, None, 0.01, True)
    (True, False, False)
    """
    if abs(delta) <= tol:
        return False
    return not (use_ci and ci is not None and ci[0] <= 0 <= ci[1])


def collapse_reasons(layers: Sequence[dict[str, Any]], dead_fraction: float, effective_experts: float) -> list[str]:
    """Routed layers whose occupancy has collapsed: too many dead experts, or too few effective ones.

    Floors, not trends: the forming atlas of early pretraining narrows its usage legitimately (a
    random router spreads tokens nearly uniformly), so only a layer that has lost most of its
    experts, or routes onto about as many experts as a token selects, counts as a collapse.
    """
    out = []
    for lay in layers:
        name = lay.get("name") or f"layer {lay.get('ordinal')}"
        n, k = lay.get("num_experts"), lay.get("top_k")
        dead, h = lay.get("dead_experts"), lay.get("router_entropy")
        if isinstance(n, int) and isinstance(dead, (int, float)) and dead > dead_fraction * n:
            out.append(f"{name}: {dead:g} of {n} experts dead (more than {dead_fraction:g} of them)")
        if isinstance(k, int) and isinstance(h, (int, float)) and math.exp(h) < effective_experts * k:
            out.append(f"{name}: effective experts exp(H) = {math.exp(h):.2f} < {effective_experts:g} x top-k {k}")
    return out


def v2_c1_failures(layers: Sequence[dict[str, Any]]) -> list[str] | None:
    """Protected layers whose V2 C1 axis does not pass (None when no protected layer carries it)."""
    rows = [lay for lay in layers if lay.get("protected") and lay.get("v2_c1_pass") is not None]
    if not rows:
        return None
    return [str(lay.get("name") or lay.get("ordinal")) for lay in rows if not lay["v2_c1_pass"]]


def readiness_floor(layers: Sequence[dict[str, Any]], dead_fraction: float, effective_fraction: float) -> list[str]:
    """Routed layers below the occupancy floor of handoff readiness: more than ``dead_fraction`` of the experts
    dead, or fewer effective experts ``exp(router_entropy)`` than ``effective_fraction`` of the experts.

    Stricter than the collapse floors: a layer with 20 of 32 experts dead has not collapsed, but an atlas that
    uses 12 of 32 experts is not ready to hand off.

    >>> readiness_floor([{"name": "l1", "num_experts": 32, "dead_experts": 20, "router_entropy": 2.4}], 0.25, 0.5)
    ['l1: 20 of 32 experts dead (more than 0.25 of them)', 'l1: effective experts exp(H) = 11.02 < 0.5 x 32 experts']
    """
    out = []
    for lay in layers:
        name = lay.get("name") or f"layer {lay.get('ordinal')}"
        n, dead, h = lay.get("num_experts"), lay.get("dead_experts"), lay.get("router_entropy")
        if not isinstance(n, int):
            continue
        if isinstance(dead, (int, float)) and dead > dead_fraction * n:
            out.append(f"{name}: {dead:g} of {n} experts dead (more than {dead_fraction:g} of them)")
        if isinstance(h, (int, float)) and math.exp(h) < effective_fraction * n:
            out.append(f"{name}: effective experts exp(H) = {math.exp(h):.2f} < {effective_fraction:g} x {n} experts")
    return out


def handoff_margin_reason(reference: str | None, margin: float | None, inside_gates: int, n: int) -> str | None:
    """Why the handoff margin does not license handoff yet (None: it does): no declared healthy reference, or
    fewer than ``n`` consecutive gates with ``handoff_margin >= 0`` against it.

    >>> handoff_margin_reason(None, 0.01, 0, 2)
    'readiness: stability only (no healthy reference declared; set lifecycle.handoff_reference)'
    >>> handoff_margin_reason("ref.json", -0.03, 0, 2)
    'handoff margin -0.0300 against ref.json: 0 of 2 consecutive gates >= 0'
    >>> handoff_margin_reason("ref.json", 0.01, 2, 2) is None
    True
    """
    if reference is None:
        return "readiness: stability only (no healthy reference declared; set lifecycle.handoff_reference)"
    if inside_gates >= n:
        return None
    shown = "n/a" if margin is None else f"{margin:+.4f}"
    return f"handoff margin {shown} against {reference}: {inside_gates} of {n} consecutive gates >= 0"


def readiness_reasons(
    *,
    stable_gates: int,
    n_stable: int,
    moved_now: Sequence[str],
    ref_step: int,
    collapse: Sequence[str],
    c2_falling: str | None,
    v2_failing: list[str] | None,
    below_floor: Sequence[str] = (),
) -> list[str]:
    """Why handoff is not licensed yet (empty: ready). Table 10's first row, one clause per reason."""
    reasons = []
    if stable_gates < n_stable:
        why = f"; moved since step {ref_step}: {', '.join(moved_now)}" if moved_now else ""
        reasons.append(f"atlas not yet stable: {stable_gates} of {n_stable} consecutive stable gates{why}")
    if collapse:
        reasons.append("occupancy collapse: " + "; ".join(collapse))
    elif below_floor:
        reasons.append("occupancy below the readiness floor: " + "; ".join(below_floor))
    if c2_falling:
        reasons.append(c2_falling)
    if v2_failing is None:
        reasons.append("no V2 C1 receipt on the protected layers")
    elif v2_failing:
        reasons.append(f"V2 C1 does not pass on protected layer(s) {', '.join(v2_failing)} (boundary swaps not "
                       "gentler than interior ones)")
    return reasons
