"""The pass/fail layer: three predicates read at every post-training gate (docs/policy.md#the-three-predicates).

An operator needs three explicit verdicts beside the staged escalation:

- **protected-atlas rewrite**: is post-training repurposing the protected atlas rather than refining policy on
  it? The refinement margin (the report's eq. 32) against the post-training base, on the protected layers:
  ``fail`` when it is below 0 and its window-bootstrap CI lies below 0, ``at risk`` when it is below 0 but its
  CI reaches 0, ``pass`` when it is at least 0.
- **base-domain damage**: has the model lost what the base knew on the canary? The cumulative damage since the
  post-training base (across every resume): ``canary_nll_delta_cumulative`` above ``policy.damage_nll_tol``, or
  ``kl_base_cumulative`` above ``policy.damage_kl_tol`` while the canary NLL did not improve, with the CI
  excluding 0 (``fail``); beyond a tolerance with a CI that reaches 0 is ``at risk``; otherwise ``pass``. A KL
  with a canary NLL that improved (its CI below 0) is a move on the base domain, not damage.
- **knowledge-expansive**: a verdict between runs, not within one: a chart-preserving candidate is "not yet"
  knowledge-expansive while a broader run reaches the target it misses. ``atlas-tracking judge`` reads it from the
  runs' records; a gate records where to get it.

Without the receipt a predicate reads, its verdict is ``not measured`` with the reason. The tracker receives
``atlas/predicate/<name>`` as a code: pass 0, at risk 1, fail 2.

Example:
    >>> from atlas_tracking.schema.config import PolicyConfig
    >>> p = read_predicates({"refine_margin": -0.04, "refine_margin_ci": [-0.07, -0.01], "base_step": 0,
    ...                      "kl_base_cumulative": 0.11, "kl_base_cumulative_ci": [0.08, 0.15],
    ...                      "canary_nll_delta_cumulative": 0.01, "canary_nll_delta_cumulative_ci": [-0.01, 0.03]},
    ...                     PolicyConfig())
    >>> p["protected_rewrite"]["verdict"], p["base_damage"]["verdict"], p["knowledge_expansive"]["verdict"]
    ('fail', 'fail', 'not judged')
"""

from __future__ import annotations

from typing import Any

from atlas_tracking.artifacts.record import finite_number
from atlas_tracking.schema.config import PolicyConfig

INPUTS = ("refine_margin", "refine_margin_ci", "refine_layer", "refine_reference", "base_step", "kl_base_cumulative",
          "kl_base_cumulative_ci", "canary_nll_delta_cumulative", "canary_nll_delta_cumulative_ci")
"""The record fields the predicates read."""


def _ci(value: Any) -> tuple[float, float] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        lo, hi = finite_number(value[0]), finite_number(value[1])
        if lo is not None and hi is not None:
            return lo, hi
    return None


def protected_rewrite(record: dict[str, Any], use_ci: bool = True) -> dict[str, Any]:
    """The refinement margin's verdict (below 0: the protected atlas is being rewritten).

    >>> protected_rewrite({"refine_margin": -0.02, "refine_margin_ci": [-0.05, 0.01]})["verdict"]
    'at risk'
    >>> protected_rewrite({"refine_margin": 0.2, "refine_margin_ci": [0.1, 0.25]})["verdict"]
    'pass'
    """
    margin, ci = finite_number(record.get("refine_margin")), _ci(record.get("refine_margin_ci"))
    out: dict[str, Any] = {"margin": margin, "ci": list(ci) if ci else None, "layer": record.get("refine_layer"),
                           "reference": record.get("refine_reference")}
    if margin is None:
        return {**out, "verdict": "not measured", "reason": "no refinement margin at this gate (a baseline)"}
    if margin >= 0:
        return {**out, "verdict": "pass", "reason": f"refinement margin {margin:+.4f} >= 0 on the protected layers"}
    if use_ci and ci is not None and ci[1] >= 0:
        return {**out, "verdict": "at risk", "reason": f"refinement margin {margin:+.4f} < 0, but its CI "
                f"[{ci[0]:+.4f}, {ci[1]:+.4f}] reaches 0"}
    where = f" (worst layer {out['layer']})" if out["layer"] else ""
    return {**out, "verdict": "fail", "reason": f"refinement margin {margin:+.4f} < 0 on the protected layers{where}: "
            "post-training is repurposing the protected atlas, not refining on it"}


def base_damage(record: dict[str, Any], kl_tol: float, nll_tol: float, use_ci: bool = True) -> dict[str, Any]:
    """The cumulative base-domain damage's verdict (KL to the base and canary NLL since the base).

    The KL says how far the next-token distribution moved on the base domain, not in which direction: a move
    that lowered the canary NLL (its CI below 0) is learning, not damage, and the KL alone does not fail it.

    >>> base_damage({"kl_base_cumulative": 0.01, "kl_base_cumulative_ci": [0.005, 0.02],
    ...              "canary_nll_delta_cumulative": -0.01, "canary_nll_delta_cumulative_ci": [-0.02, 0.0]},
    ...             0.05, 0.05)["verdict"]
    'pass'
    >>> base_damage({"kl_base_cumulative": 0.15, "kl_base_cumulative_ci": [0.13, 0.16],
    ...              "canary_nll_delta_cumulative": -0.06, "canary_nll_delta_cumulative_ci": [-0.08, -0.04]},
    ...             0.05, 0.05)["reason"]
    'base-domain damage since the base (step None) inside the tolerances (KL(base || now) +0.1500 > 0.05, but the canary NLL improved: a move, not damage)'
    """
    kl, kl_ci = finite_number(record.get("kl_base_cumulative")), _ci(record.get("kl_base_cumulative_ci"))
    nll, nll_ci = (finite_number(record.get("canary_nll_delta_cumulative")),
                   _ci(record.get("canary_nll_delta_cumulative_ci")))
    out: dict[str, Any] = {"base_step": record.get("base_step"), "kl": kl, "nll_delta": nll, "kl_tol": kl_tol,
                           "nll_tol": nll_tol}
    if kl is None and nll is None:
        return {**out, "verdict": "not measured", "reason": "no damage since the post-training base at this gate "
                "(pretraining, a baseline, or no base yet)"}
    improved = nll is not None and nll < 0 and (not use_ci or nll_ci is None or nll_ci[1] < 0)
    axes = [(what, value, ci, tol) for what, value, ci, tol in (("KL(base || now)", kl, kl_ci, kl_tol),
                                                                  ("canary NLL change", nll, nll_ci, nll_tol))
            if value is not None and value > tol]
    moved = [a for a in axes if a[0].startswith("KL")] if improved else []
    beyond = [a for a in axes if a not in moved]
    sure = [a for a in beyond if not use_ci or a[2] is None or a[2][0] > 0]
    since = f"base-domain damage since the base (step {out['base_step']})"
    note = (f" ({moved[0][0]} {moved[0][1]:+.4f} > {moved[0][3]:g}, but the canary NLL improved: a move, not damage)"
            if moved else "")
    if sure:
        text = "; ".join(f"{what} {value:+.4f} > {tol:g}" for what, value, _, tol in sure)
        return {**out, "verdict": "fail", "reason": f"{since}: {text}, CI excluding 0"}
    if beyond:
        text = "; ".join(f"{what} {value:+.4f} > {tol:g} (CI reaches 0)" for what, value, _, tol in beyond)
        return {**out, "verdict": "at risk", "reason": f"{since}: {text}"}
    return {**out, "verdict": "pass", "reason": f"{since} inside the tolerances{note}"}


def knowledge_expansive() -> dict[str, Any]:
    """The between-runs predicate, as a gate records it: where the verdict comes from."""
    return {"verdict": "not judged", "reason": "a verdict between runs: atlas-tracking judge STRESSED --candidate "
            "A [B ...] classifies each chart-preserving candidate (docs/policy.md#the-judge)"}


def read_predicates(record: dict[str, Any], cfg: PolicyConfig) -> dict[str, dict[str, Any]]:
    """The three predicates of one post-training gate (each a ``verdict``, its ``reason`` and the numbers)."""
    return {
        "protected_rewrite": protected_rewrite(record, cfg.use_ci),
        "base_damage": base_damage(record, cfg.damage_kl_tol, cfg.damage_nll_tol, cfg.use_ci),
        "knowledge_expansive": knowledge_expansive(),
    }
