"""``atlas-tracking judge``: is a candidate run a real fix of a stressed run? (docs/policy.md#the-judge)

A fix counts as real only if it improves the geometry at matched scalar quality. The judge reads
both runs' histories (:func:`~atlas_tracking.artifacts.history.read_history`), pairs gates at matched loss,
and applies the paper's four checks to the paired deltas (candidate minus stressed), then a fifth on the
losses themselves:

1. ``state2``: C2 (the summary, mean over routed layers) improves by more than ``policy.c2_tol``
   (and, with paired CIs, the CI of the delta lies above 0). When both gates have no C2 (top-1 routing, the
   records' ``c2_absent``) the check reads ``n/a`` (a pass, with the reason), and the fix is read from
   occupancy: check 3 then needs occupancy to broaden (docs/policy.md#top-1-routing).
2. ``occupancy``: occupancy broadens on all three axes: dead experts down by more than
   ``policy.dead_tol`` (two runs that both have no dead expert pass this axis: there is nothing to
   revive), min router entropy up by more than ``policy.entropy_tol`` nats, mean load CV (x100) down by
   more than ``policy.cv_tol``; with paired CIs each CI must also exclude 0 on the broadening side.
   When the stressed run's occupancy stayed healthy (below) there is nothing to broaden: the check
   reads ``not needed`` (a pass, with the reason) as long as the candidate does not narrow it, i.e. no
   axis moves the other way by more than its tolerance (dead experts up by more than ``dead_tol``, min
   entropy down by more than ``entropy_tol``, mean CV up by more than ``cv_tol``; with a paired CI, one
   that excludes 0 on that side).
3. ``not_state1_only``: the gain is carried by State2 or by an occupancy that broadened (a ``not
   needed`` occupancy is no gain), not by the State1 margin alone; a widened margin with neither is named
   as a State1-only gain.
4. ``persistence``: checks 1-3 pass together at every candidate gate with a loss from the first matched
   gate on, and there are at least ``policy.n_recover`` such gates (a single convenient checkpoint, or a
   recovery followed by a relapse at any later gate, fails; the failing steps are named).
5. ``scalar_quality``: the candidate reaches the stressed run's scalar quality: its best loss is at most
   ``loss_tol`` above the stressed run's final loss (its last gate with a loss). A candidate that does not
   gave the scalar win back: you do not get credit by simply failing the task.

Every loss is read in the objective's direction (each record's ``objective_direction``, minimised when absent): for
a maximised objective (a reward), "best" is the highest, "above" is below, and a candidate reaches the stressed
run's quality when its best value is at least the stressed final value less ``loss_tol``. Two runs whose gates read
different directions, or two different named metrics (``loss_key``), are not comparable.

Checks 1-3 are read at the latest matched gate. Matching: every candidate gate with a loss is paired
with the stressed gate of nearest loss (ties: the stressed gate nearest in step, then the earlier) when
the two losses differ by at most ``loss_tol`` (absolute, in the loss's own unit); other candidate gates
are left unpaired and listed. A stressed gate may be matched by several candidate gates. Persistence
also reads the unpaired candidate gates after the first matched one, each against the stressed gate of
nearest loss (same ties), or against the stressed run's final gate when the candidate's loss is below
every stressed loss. Candidate gates without a loss are not read.

Healthy stressed occupancy: the stressed run's gates that carry all three occupancy numbers (dead
experts, min entropy, mean CV) are at least two, and none of them degraded from the first of them on any
axis: dead experts at most ``dead_tol`` above it, min entropy at most ``entropy_tol`` below it, mean CV
at most ``cv_tol`` above it. One such gate is no evidence either way, and is not healthy.

Evidence: when both gates of a pair keep their receipts artifacts (``receipts/step_N.json`` whose
sha256 matches the record) on the same canary layout and routed layers, each delta carries the paired
window-bootstrap 95% CI (docs/receipts.md#paired-deltas: the same window resamples for both runs, the receipts
re-derived from the per-window arrays); otherwise the evidence is the point deltas of the records, and
the output says so.

Verdict: ``real fix`` (all five checks pass), ``not yet`` (names the failing checks) or
``not comparable`` (says why: different canary fingerprints, different objectives, no gate at matched loss,
missing receipts fields). Records that carry no canary fingerprint at all (hand-written sequences such as the paper's
tables) are compared as given, with that caveat stated; one side with a fingerprint and one without,
or two different fingerprints, is not comparable.

Beside the verdict, each candidate gets two more predicates: ``chart_preserving`` (checks 1 and 2 pass)
and ``knowledge_expansive``, read on chart-preserving candidates only (None otherwise): ``yes`` when its
final loss reaches the target (the stressed run's final loss, within ``loss_tol``), else ``not yet``.
:func:`judge_many_records` judges several candidates against one stressed run and names, for a
chart-preserving candidate short of the target, the broader candidates that reached it with a final
loss lower than its own by more than ``loss_tol`` (``reached_by``).

Example:
    >>> stressed = [{"step": 0, "loss": None, "c2": 0.08, "dead_experts": 42, "min_entropy": 3.0, "mean_cv": 140}]
    >>> stressed += [{"step": s, "loss": l, "c2": -0.03, "dead_experts": 285, "min_entropy": 2.3, "mean_cv": 190,
    ...               "margin": 0.01} for s, l in [(500, 4.7), (1000, 4.5)]]
    >>> better = [{"step": s, "loss": l, "c2": 0.02, "dead_experts": 200, "min_entropy": 2.6, "mean_cv": 160,
    ...            "margin": 0.01} for s, l in [(500, 4.71), (1000, 4.52)]]
    >>> out = judge_records(stressed, better)
    >>> out["verdict"], [(c["name"], c["passed"]) for c in out["checks"]]  # doctest: +NORMALIZE_WHITESPACE
    ('real fix', [('state2', True), ('occupancy', True), ('not_state1_only', True), ('persistence', True),
                  ('scalar_quality', True)])
    >>> stuck = [dict(g, loss=4.7) for g in better]  # the same geometry, never below the stressed loss 4.7
    >>> judge_records(stressed, stuck)["failing"]
    ['scalar_quality']
    >>> rewards = [dict(g, loss_key="eval_reward", objective_direction="maximize") for g in better]
    >>> judge_records(stressed, rewards)["reason"]
    'different objectives: stressed an unnamed metric (minimize), candidate eval_reward (maximize)'
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from atlas_tracking.artifacts.gate_report import ArtifactError, read_artifact
from atlas_tracking.artifacts.history import HistoryError, read_run_gates
from atlas_tracking.artifacts.io import jsonable
from atlas_tracking.artifacts.record import finite_number
from atlas_tracking.artifacts.run_dir import RunDir, file_sha256
from atlas_tracking.decisions.policy import cost_sign, objective_name
from atlas_tracking.receipts.paired import occupancy_samples
from atlas_tracking.receipts.stats import bootstrap_indices, percentile_ci, ratio_samples
from atlas_tracking.schema.config import AtlasConfig

REAL_FIX, NOT_YET, NOT_COMPARABLE = "real fix", "not yet", "not comparable"
EXIT_CODES = {REAL_FIX: 0, NOT_YET: 1, NOT_COMPARABLE: 2}
CHECKS = {
    "state2": "State2 (C2) improves materially",
    "occupancy": "occupancy broadens (dead down, entropy up, CV down), or is not needed",
    "not_state1_only": "the gain is not carried by State1 alone",
    "persistence": "the improvement persists at every gate from the first matched one",
    "scalar_quality": "the candidate reaches the stressed run's scalar quality (its final objective)",
}
DELTAS = ("c2", "dead_experts", "min_entropy", "mean_cv", "margin")
REQUIRED = ("c2", "dead_experts", "min_entropy", "mean_cv")
OCCUPANCY = ("dead_experts", "min_entropy", "mean_cv")
DEFAULT_LOSS_TOL = 0.05
"""Default matching tolerance: two gates are at matched loss when their losses differ by at most this."""


class JudgeError(ValueError):
    """A run's record cannot be read (no gates file, a bad line): bad input, exit code 2."""


def _fingerprint(records: list[dict[str, Any]], name: str) -> tuple[str | None, str | None]:
    """(the run's one canary fingerprint or None, a reason the run is not comparable or None)."""
    prints = {r.get("canary_fingerprint") for r in records}
    if len(prints) > 1:
        return None, f"the {name} run's history mixes canaries ({len(prints)} fingerprints)"
    return prints.pop(), None


def _with_loss(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if finite_number(r.get("loss")) is not None]


def _objective(records: list[dict[str, Any]], name: str) -> tuple[dict[str, Any], str | None]:
    """The objective a run's gates with a loss read (``metric``: the one ``loss_key`` they name, or None; ``direction``:
    minimised when no gate says otherwise), and a reason the run is not comparable when they read more than one.

    >>> _objective([{"loss": 0.1, "loss_key": "eval_reward", "objective_direction": "maximize"}], "candidate")
    ({'metric': 'eval_reward', 'direction': 'maximize'}, None)
    """
    read = {(r.get("loss_key"), r.get("objective_direction") or "minimize") for r in _with_loss(records)}
    metrics = sorted({m for m, _ in read if m is not None})
    directions = sorted({d for _, d in read}) or ["minimize"]
    objective = {"metric": metrics[0] if metrics else None, "direction": directions[0]}
    if len(metrics) > 1 or len(directions) > 1:
        return objective, (f"the {name} run's history reads more than one objective: "
                           + ", ".join(f"{m or 'unnamed'} ({d})" for m, d in sorted(read, key=str)))
    return objective, None


def _objective_text(objective: dict[str, Any]) -> str:
    return f"{objective['metric'] or 'an unnamed metric'} ({objective['direction']})"


def _same_objective(stressed: dict[str, Any], candidate: dict[str, Any]) -> bool:
    """The same direction, and the same metric where both runs name one (a plain loop's gates name none)."""
    metrics = {stressed["metric"], candidate["metric"]} - {None}
    return stressed["direction"] == candidate["direction"] and len(metrics) <= 1


def _nearest(pool: list[dict[str, Any]], c: dict[str, Any], lc: float) -> dict[str, Any]:
    """The stressed gate of nearest loss to ``c`` (ties: nearest in step, then the earlier)."""
    return min(pool, key=lambda s: (abs(float(s["loss"]) - lc), abs(s["step"] - c["step"]), s["step"]))


def _pairs(stressed: list[dict[str, Any]], candidate: list[dict[str, Any]], loss_tol: float, sign: int = 1):
    """Candidate gates paired with the stressed gate of nearest loss, within ``loss_tol``; the unpaired; and the
    persistence trail: ``(stressed, candidate, matched)`` for every candidate gate with a loss from the first
    matched one on, an unmatched gate read against the stressed gate of nearest loss (the stressed run's final
    gate when its loss is better than every stressed loss: lower times ``sign``, :func:`cost_sign`)."""
    pool = _with_loss(stressed)
    pairs, unpaired, trail = [], [], []
    for c in _with_loss(candidate):
        lc = float(c["loss"])
        if not pool:
            unpaired.append({"step": c["step"], "loss": lc, "why": "the stressed run has no gate with a loss",
                             "against": None})
            continue
        best = _nearest(pool, c, lc)
        gap = abs(float(best["loss"]) - lc)
        if gap <= loss_tol:
            pairs.append((best, c))
            trail.append((best, c, True))
            continue
        against = None
        if trail:
            against = pool[-1] if sign * lc < min(sign * float(s["loss"]) for s in pool) else best
            trail.append((against, c, False))
        unpaired.append({"step": c["step"], "loss": lc, "why": f"nearest stressed loss {best['loss']} is "
                         f"{gap:.4g} away (> {loss_tol})", "against": None if against is None else against["step"]})
    return pairs, unpaired, trail


def stressed_occupancy(stressed: list[dict[str, Any]], config: AtlasConfig | None = None) -> dict[str, Any]:
    """Whether the stressed run's occupancy stayed healthy (see the module docstring), and where it degraded.

    >>> g = lambda s, dead: {"step": s, "dead_experts": dead, "min_entropy": 2.9, "mean_cv": 150}
    >>> stressed_occupancy([g(0, 10), g(500, 10)])["healthy"], stressed_occupancy([g(0, 10), g(500, 12)])["degraded_at"]
    (True, [500])
    """
    pol = (config or AtlasConfig()).policy
    gates = [r for r in stressed if all(finite_number(r.get(k)) is not None for k in OCCUPANCY)]
    out: dict[str, Any] = {"healthy": False, "reference_step": gates[0]["step"] if gates else None,
                           "gates": len(gates), "degraded_at": [], "degraded": [], "note": None}
    if len(gates) < 2:
        out["note"] = (f"{len(gates)} stressed gate(s) carry dead experts, min entropy and mean CV: no evidence "
                       "that the occupancy stayed healthy")
        return out
    ref = {k: float(gates[0][k]) for k in OCCUPANCY}
    for r in gates[1:]:
        worse = {"dead_experts": float(r["dead_experts"]) - ref["dead_experts"] > pol.dead_tol,
                 "min_entropy": ref["min_entropy"] - float(r["min_entropy"]) > pol.entropy_tol,
                 "mean_cv": float(r["mean_cv"]) - ref["mean_cv"] > pol.cv_tol}
        axes = [k for k, bad in worse.items() if bad]
        if axes:
            out["degraded"].append({"step": r["step"], "axes": axes})
    out["degraded_at"] = [d["step"] for d in out["degraded"]]
    out["healthy"] = not out["degraded"]
    out["note"] = (f"healthy: none of its {len(gates)} gates degraded from its first gate (step "
                   f"{out['reference_step']}) by more than the tolerances" if out["healthy"] else
                   f"degraded from its first gate (step {out['reference_step']}) at step(s) "
                   + ", ".join(f"{d['step']} ({', '.join(d['axes'])})" for d in out["degraded"]))
    return out


# --- paired window-bootstrap CIs from the receipts artifacts -------------------------------------------


def _artifact(path: Path | None, record: dict[str, Any]) -> dict[str, Any] | None:
    """The record's receipts artifact when it is kept beside the record and its sha256 matches."""
    sha = record.get("receipts_sha256")
    if path is None or not sha:
        return None
    file = RunDir(path).receipts_file(record["step"])
    if file_sha256(file) != sha:
        return None
    try:
        return read_artifact(file)
    except ArtifactError:
        return None


def _summary_samples(data: dict[str, Any], idx: np.ndarray) -> dict[str, np.ndarray]:
    """Bootstrap replicates of the summaries the checks read: c2 and margin (mean over layers), dead experts
    (mean), min entropy (min) and mean CV (x100, mean), each resample drawing the same windows for all layers."""
    layers = data["per_window"]["layers"]

    def mean_ratio(key: str) -> np.ndarray:
        rows = [ratio_samples(np.asarray(lay[key]["sum"], float), np.asarray(lay[key]["count"], float), idx)
                for lay in layers]
        with np.errstate(invalid="ignore"):
            return np.nanmean(np.vstack(rows), axis=0)

    occ = [occupancy_samples(np.asarray(lay["load"]), np.asarray(lay["load"]), idx)["now"] for lay in layers]
    return {
        "c2": mean_ratio("c2"),
        "margin": mean_ratio("margin_mean"),
        "dead_experts": np.mean([o["dead_experts"][1:] for o in occ], axis=0),
        "min_entropy": np.min([o["router_entropy"][1:] for o in occ], axis=0),
        "mean_cv": 100.0 * np.mean([o["load_cv"][1:] for o in occ], axis=0),
    }


def _paired_cis(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, list[float]] | None:
    """CIs of (candidate ``b`` - stressed ``a``) for every delta, or None when the artifacts cannot be paired."""
    if a is None or b is None:
        return None
    if (a["canary"].get("fingerprint") != b["canary"].get("fingerprint")
            or [lay["name"] for lay in a["layers"]] != [lay["name"] for lay in b["layers"]]):
        return None
    rc = b["config"]["receipts"]
    idx = bootstrap_indices(int(b["canary"]["n_windows"]), int(rc["n_bootstrap"]), int(rc["seed"]))
    try:
        sa, sb = _summary_samples(a, idx), _summary_samples(b, idx)
    except (KeyError, ValueError, TypeError):
        return None
    return {k: list(percentile_ci(sb[k] - sa[k], float(rc["ci_level"]))) for k in DELTAS}


# --- the checks ---------------------------------------------------------------------------------------


def _inside(ci: list[float] | None, side: str) -> bool:
    """No CI (point evidence), or a CI that excludes 0 on ``side`` ('+' above, '-' below)."""
    if ci is None or any(v is None or not math.isfinite(v) for v in ci):
        return ci is None
    return ci[0] > 0 if side == "+" else ci[1] < 0



def _read_pair(s: dict[str, Any], c: dict[str, Any], cis: dict[str, list[float]] | None, pol,
               healthy: bool, matched: bool = True) -> dict[str, Any]:
    d = {k: (None if finite_number(c.get(k)) is None or finite_number(s.get(k)) is None else float(c[k]) - float(s[k])) for k in DELTAS}
    ci = (cis or {}).get
    no_c2 = d["c2"] is None  # both gates state c2_absent (checked before)
    state2 = no_c2 or (d["c2"] > pol.c2_tol and _inside(ci("c2"), "+"))
    no_dead = float(s["dead_experts"]) == 0 and float(c["dead_experts"]) == 0
    axes = {
        "dead_experts": no_dead or (d["dead_experts"] < -pol.dead_tol and _inside(ci("dead_experts"), "-")),
        "min_entropy": d["min_entropy"] > pol.entropy_tol and _inside(ci("min_entropy"), "+"),
        "mean_cv": d["mean_cv"] < -pol.cv_tol and _inside(ci("mean_cv"), "-"),
    }
    narrowed = [k for k, bad in (
        ("dead_experts", d["dead_experts"] > pol.dead_tol and _inside(ci("dead_experts"), "+")),
        ("min_entropy", d["min_entropy"] < -pol.entropy_tol and _inside(ci("min_entropy"), "-")),
        ("mean_cv", d["mean_cv"] > pol.cv_tol and _inside(ci("mean_cv"), "+"))) if bad]
    broadened = all(axes.values())
    status = "passed" if broadened else "not needed" if healthy and not narrowed else "failed"
    return {
        "stressed_step": s["step"], "candidate_step": c["step"], "stressed_loss": finite_number(s.get("loss")),
        "candidate_loss": finite_number(c.get("loss")), "matched": matched, "deltas": d, "ci": cis,
        "evidence": "paired window-bootstrap CIs" if cis else "point deltas",
        "state2": state2, "occupancy": status != "failed", "occupancy_status": status, "occupancy_axes": axes,
        "occupancy_narrowed": narrowed, "margin_widened": d["margin"] is not None and d["margin"] > 0,
        "not_state1_only": (state2 and not no_c2) or broadened,
        "c2_absent": c.get("c2_absent") if no_c2 else None,
    }


def _occupancy_note(p: dict[str, Any], healthy: dict[str, Any]) -> str | None:
    if p["occupancy_status"] == "not needed":
        return (f"not needed: the stressed run's occupancy stayed healthy (none of its {healthy['gates']} gates "
                f"degraded from its first gate, step {healthy['reference_step']}, by more than the tolerances), so "
                "there is nothing to broaden, and the candidate does not narrow it")
    if healthy["healthy"] and p["occupancy_narrowed"]:
        return ("the stressed run's occupancy stayed healthy, so broadening is not needed, but the candidate "
                f"narrowed it ({', '.join(p['occupancy_narrowed'])})")
    return None


def _scalar(stressed: list[dict[str, Any]], candidate: list[dict[str, Any]], loss_tol: float,
            objective: dict[str, Any]) -> dict[str, Any]:
    """Check 5 in the objective's direction: the candidate's best value against the stressed run's final one."""
    sign, word = cost_sign(objective["direction"]), objective_name(objective["direction"], objective["metric"])
    final = _with_loss(stressed)[-1]
    best = min(_with_loss(candidate), key=lambda c: (sign * float(c["loss"]), c["step"]))
    b, f = float(best["loss"]), float(final["loss"])
    passed = sign * (b - f) <= loss_tol
    return {"name": "scalar_quality", "title": CHECKS["scalar_quality"], "passed": passed,
            "candidate_best_loss": b, "candidate_best_step": best["step"], "stressed_final_loss": f,
            "stressed_final_step": final["step"], "loss_tol": loss_tol, "objective": word,
            "direction": objective["direction"],
            "note": None if passed else (
                f"the scalar win was given back: the candidate's best {word} {b:.4g} (step {best['step']}) is "
                f"{abs(b - f):.4g} {'above' if sign > 0 else 'below'} the stressed run's final {word} {f:.4g} (step "
                f"{final['step']}), more than the tolerance {loss_tol}")}


def _checks(pairs: list[dict[str, Any]], trail: list[dict[str, Any]], n_persist: int,
            healthy: dict[str, Any], scalar: dict[str, Any]) -> list[dict[str, Any]]:
    last = pairs[-1]
    d = last["deltas"]
    ci = last["ci"] or {}
    at = {"stressed_step": last["stressed_step"], "candidate_step": last["candidate_step"], "evidence": last["evidence"]}
    state1 = ("only State1 moved: the margin widened while State2 and occupancy did not improve"
              if last["margin_widened"] and not last["not_state1_only"] else None)
    joint = [p["state2"] and p["occupancy"] and p["not_state1_only"] for p in trail]
    relapse = [p["candidate_step"] for p, ok in zip(trail, joint) if not ok]
    notes = []
    if relapse:
        notes.append(f"checks 1-3 fail at candidate step(s) {', '.join(str(s) for s in relapse)}")
    if len(trail) < n_persist:
        notes.append(f"{len(trail)} gate(s) from the first matched gate; persistence needs {n_persist}")
    return [
        {"name": "state2", "title": CHECKS["state2"], "passed": last["state2"], **at,
         "c2_delta": d["c2"], "c2_delta_ci": None if last["c2_absent"] else ci.get("c2"),
         **({"status": f"n/a ({last['c2_absent']})",
             "note": f"n/a ({last['c2_absent']}): neither run has C2; the fix is read from occupancy"}
            if last["c2_absent"] else {})},
        {"name": "occupancy", "title": CHECKS["occupancy"], "passed": last["occupancy"], **at,
         "status": last["occupancy_status"], "axes": last["occupancy_axes"], "narrowed": last["occupancy_narrowed"],
         **{f"{k}_delta": d[k] for k in OCCUPANCY},
         **{f"{k}_delta_ci": ci.get(k) for k in OCCUPANCY}, "note": _occupancy_note(last, healthy)},
        {"name": "not_state1_only", "title": CHECKS["not_state1_only"], "passed": last["not_state1_only"], **at,
         "margin_delta": d["margin"], "margin_delta_ci": ci.get("margin"), "note": state1},
        {"name": "persistence", "title": CHECKS["persistence"], "passed": len(trail) >= n_persist and not relapse,
         "required_gates": n_persist, "gates": [p["candidate_step"] for p in trail], "passed_at": joint,
         "against": [p["stressed_step"] for p in trail], "matched": [p["matched"] for p in trail],
         "relapse_steps": relapse, "note": "; ".join(notes) or None},
        scalar,
    ]


def _knowledge(out: dict[str, Any], loss_tol: float) -> None:
    """The chart-preserving and knowledge-expansive predicates of one judged candidate (in place)."""
    checks = {c["name"]: c["passed"] for c in out["checks"]}
    out["chart_preserving"] = bool(checks.get("state2") and checks.get("occupancy"))
    target, final = out["target_loss"], out["final_loss"]
    sign, word = cost_sign(out["objective"]["direction"]), objective_name(**out["objective"])
    out["reaches_target"] = None if target is None or final is None else sign * (final - target) <= loss_tol
    if not out["checks"]:
        out["knowledge_note"] = "not comparable: neither predicate is read"
    elif not out["chart_preserving"]:
        out["knowledge_note"] = ("not chart-preserving (state2 or occupancy does not pass): knowledge-expansive "
                                 "is read on chart-preserving candidates only")
    elif out["reaches_target"]:
        out["knowledge_expansive"] = "yes"
        out["knowledge_note"] = (f"chart-preserving and at the target: final {word} {final:.4g} within {loss_tol} of "
                                 f"the stressed run's final {word} {target:.4g}")
    else:
        out["knowledge_expansive"] = "not yet"
        out["knowledge_note"] = (f"chart-preserving, but its final {word} {final:.4g} is more than {loss_tol} "
                                 f"{'above' if sign > 0 else 'below'} the target (the stressed run's final {word} "
                                 f"{target:.4g})")


def judge_records(stressed: list[dict[str, Any]], candidate: list[dict[str, Any]], config: AtlasConfig | None = None,
                  loss_tol: float = DEFAULT_LOSS_TOL, stressed_dir: Path | None = None,
                  candidate_dir: Path | None = None) -> dict[str, Any]:
    """The verdict on two runs' histories (see the module docstring). ``*_dir`` hold the receipts artifacts."""
    if not loss_tol >= 0:
        raise JudgeError(f"loss tolerance must be >= 0, got {loss_tol!r}")
    pol = (config or AtlasConfig()).policy
    final_s, final_c = _with_loss(stressed)[-1:], _with_loss(candidate)[-1:]
    healthy = stressed_occupancy(stressed, config)
    out: dict[str, Any] = {"verdict": NOT_COMPARABLE, "reason": None, "failing": [], "checks": [], "pairs": [],
                           "unpaired": [], "loss_tol": loss_tol, "n_persist": pol.n_recover,
                           "tolerances": {k: getattr(pol, k) for k in ("c2_tol", "dead_tol", "entropy_tol", "cv_tol")},
                           "stressed_occupancy": healthy,
                           "target_loss": float(final_s[0]["loss"]) if final_s else None,
                           "final_loss": float(final_c[0]["loss"]) if final_c else None,
                           "chart_preserving": False, "reaches_target": None, "knowledge_expansive": None,
                           "reached_by": [], "knowledge_note": None}
    fa, why_a = _fingerprint(stressed, "stressed")
    fb, why_b = _fingerprint(candidate, "candidate")
    out["canary_fingerprint"] = fb
    (objective, why_c), (theirs, why_d) = _objective(stressed, "stressed"), _objective(candidate, "candidate")
    out["objective"] = objective
    if why_a or why_b or why_c or why_d:
        out["reason"] = why_a or why_b or why_c or why_d
        return _done(out, loss_tol)
    if not _same_objective(objective, theirs):
        out["reason"] = (f"different objectives: stressed {_objective_text(objective)}, candidate "
                         f"{_objective_text(theirs)}")
        return _done(out, loss_tol)
    if fa != fb:
        out["reason"] = (f"different canaries: stressed {fa or 'no fingerprint'}, candidate {fb or 'no fingerprint'} "
                         "(receipts are comparable only on the same canary)")
        return _done(out, loss_tol)
    if fa is None:
        out["caveat"] = "neither record carries a canary fingerprint: the runs are trusted to share one canary"
    raw, out["unpaired"], trail = _pairs(stressed, candidate, loss_tol, cost_sign(objective["direction"]))
    if not raw:
        out["reason"] = f"no candidate gate is at matched loss (within {loss_tol}) with a stressed gate"
        return _done(out, loss_tol)
    for s, c, matched in trail:
        missing = [k for k in REQUIRED if (finite_number(s.get(k)) is None or finite_number(c.get(k)) is None)
                   and not (k == "c2" and s.get("c2_absent") and c.get("c2_absent"))]
        if missing:
            out["reason"] = (f"matched gates {s['step']} / {c['step']} lack {', '.join(missing)}" if matched else
                             f"candidate gate {c['step']} (read for persistence against stressed gate {s['step']}) "
                             f"or that stressed gate lacks {', '.join(missing)}")
            return _done(out, loss_tol)
    cis = [_paired_cis(_artifact(stressed_dir, s), _artifact(candidate_dir, c)) for s, c, _ in trail]
    rows = [_read_pair(s, c, ci, pol, healthy["healthy"], matched) for (s, c, matched), ci in zip(trail, cis)]
    out["pairs"] = [r for r in rows if r["matched"]]
    out["evidence"] = ("paired window-bootstrap CIs" if all(cis) else
                       "point deltas" if not any(cis) else "paired CIs on some gates, point deltas on the others")
    out["checks"] = _checks(out["pairs"], rows, pol.n_recover, healthy,
                            _scalar(stressed, candidate, loss_tol, objective))
    out["failing"] = [c["name"] for c in out["checks"] if not c["passed"]]
    out["verdict"] = NOT_YET if out["failing"] else REAL_FIX
    if "scalar_quality" in out["failing"]:
        out["reason"] = out["checks"][-1]["note"]
    return _done(out, loss_tol)


def _done(out: dict[str, Any], loss_tol: float) -> dict[str, Any]:
    _knowledge(out, loss_tol)
    return jsonable(out)


def judge_many_records(stressed: list[dict[str, Any]], candidates: list[list[dict[str, Any]]],
                       config: AtlasConfig | None = None, loss_tol: float = DEFAULT_LOSS_TOL,
                       stressed_dir: Path | None = None, candidate_dirs: list[Path | None] | None = None,
                       names: list[str] | None = None) -> dict[str, Any]:
    """Several candidates judged against one stressed run, each as by :func:`judge_records` (with its ``name``),
    and the knowledge-expansive predicate read across them: a chart-preserving candidate whose final loss is
    short of the target is ``not yet`` and names in ``reached_by`` every other candidate whose final loss
    reaches the target (within ``loss_tol`` of the stressed run's final loss) and is better than its own (lower;
    higher for a maximised objective) by more than ``loss_tol``. Returns ``target_loss``, ``objective`` (the
    stressed run's), ``loss_tol``, ``reached_target`` (the names) and ``candidates`` (the results, in order)."""
    names = list(names) if names is not None else [f"candidate {i + 1}" for i in range(len(candidates))]
    dirs = list(candidate_dirs) if candidate_dirs is not None else [None] * len(candidates)
    if not candidates or len(names) != len(candidates) or len(dirs) != len(candidates):
        raise JudgeError(f"{len(candidates)} candidate(s), {len(names)} name(s), {len(dirs)} directory(ies): "
                         "give at least one candidate, one name and one directory each")
    if len(set(names)) != len(names):
        raise JudgeError(f"candidate names must differ, got {names}")
    results = [{"name": n, **judge_records(stressed, c, config, loss_tol, stressed_dir, d)}
               for n, c, d in zip(names, candidates, dirs)]
    reached = [r for r in results if r["reaches_target"]]
    objective = results[0]["objective"]
    sign, word = cost_sign(objective["direction"]), objective_name(**objective)
    for r in results:
        if r["knowledge_expansive"] != "not yet":
            continue
        r["reached_by"] = [o["name"] for o in reached
                           if o is not r and sign * (o["final_loss"] - r["final_loss"]) < -loss_tol]
        r["knowledge_note"] += ("; reached by " + ", ".join(
            f"{o['name']} (final {word} {o['final_loss']:.4g})" for o in reached if o["name"] in r["reached_by"])
            if r["reached_by"] else "; no other candidate reaches it")
    target = results[0]["target_loss"]
    return jsonable({"target_loss": target, "objective": objective, "loss_tol": loss_tol,
                     "reached_target": [r["name"] for r in reached], "candidates": results})


def _history(path: str | Path, name: str) -> tuple[list[dict[str, Any]], Path]:
    try:
        records, file = read_run_gates(path)
    except (HistoryError, OSError) as exc:
        raise JudgeError(f"{name} run: {exc}") from None
    return records, file.parent


def judge(stressed: str | Path, candidate: str | Path, config: AtlasConfig | None = None,
          loss_tol: float = DEFAULT_LOSS_TOL) -> dict[str, Any]:
    """Judge a candidate run against a stressed run; each is a run's atlas directory or its ``gates.jsonl``.

    Returns ``verdict`` (``real fix`` | ``not yet`` | ``not comparable``), ``checks`` (one entry per check
    with ``passed`` and its numbers), ``failing``, ``reason``, the matched ``pairs`` and ``evidence``, and the
    ``chart_preserving`` / ``knowledge_expansive`` predicates. Raises :class:`JudgeError` when a record cannot
    be read.
    """
    a, dir_a = _history(stressed, "stressed")
    b, dir_b = _history(candidate, "candidate")
    return judge_records(a, b, config, loss_tol, dir_a, dir_b)


def judge_many(stressed: str | Path, candidates: list[str | Path], config: AtlasConfig | None = None,
               loss_tol: float = DEFAULT_LOSS_TOL) -> dict[str, Any]:
    """Judge several candidate runs against one stressed run (:func:`judge_many_records`); each candidate is
    named by its path as given."""
    a, dir_a = _history(stressed, "stressed")
    read = [_history(c, f"candidate {c}") for c in candidates]
    return judge_many_records(a, [r for r, _ in read], config, loss_tol, dir_a, [d for _, d in read],
                              [str(c) for c in candidates])


# --- command line -------------------------------------------------------------------------------------


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:+.4g}"
    if isinstance(x, list):
        return "[" + ", ".join(_fmt(v) for v in x) + "]"
    return str(x)


def table(result: dict[str, Any]) -> str:
    """The readable verdict: one line per check with its numbers, then the matched gates."""
    lines = [f"verdict: {result['verdict']}"]
    if result["reason"]:
        lines.append(f"  why: {result['reason']}")
    if result.get("caveat"):
        lines.append(f"  note: {result['caveat']}")
    if result["checks"]:
        lines.append(f"evidence: {result['evidence']}; loss matched within {result['loss_tol']}")
    for c in result["checks"]:
        nums = {k: v for k, v in c.items() if k.endswith(("_delta", "_delta_ci"))}
        detail = " ".join(f"{k}={_fmt(v)}" for k, v in nums.items() if v is not None)
        if c["name"] == "persistence":
            detail = (f"gates {c['gates']} against stressed {c['against']} passed {c['passed_at']} "
                      f"(needs {c['required_gates']})")
        elif c["name"] == "scalar_quality":
            detail = (f"best {c['objective']} {c['candidate_best_loss']:.4g} (step {c['candidate_best_step']}) vs "
                      f"stressed final {c['objective']} {c['stressed_final_loss']:.4g} (step "
                      f"{c['stressed_final_step']}), tolerance {c['loss_tol']}")
        note = c.get("note")
        if c["name"] == "scalar_quality" and note:  # the note restates the numbers
            detail, note = note, None
        mark = "PASS" if c["passed"] else "FAIL"
        lines.append(f"  {mark}  {c['title']}: {detail}" + (f" ({note})" if note else ""))
    for p in result["pairs"]:
        lines.append(f"  pair: stressed step {p['stressed_step']} (loss {p['stressed_loss']}) / candidate step "
                     f"{p['candidate_step']} (loss {p['candidate_loss']}): C2 {_fmt(p['deltas']['c2'])}, "
                     f"dead {_fmt(p['deltas']['dead_experts'])}, {p['evidence']}")
    for u in result["unpaired"]:
        lines.append(f"  unpaired candidate step {u['step']} (loss {u['loss']}): {u['why']}"
                     + (f"; persistence reads it against stressed step {u['against']}" if u.get("against") is not None
                        else ""))
    if result["checks"]:
        lines.append(f"chart-preserving: {'yes' if result['chart_preserving'] else 'no'}; knowledge-expansive: "
                     f"{result['knowledge_expansive'] or '-'} ({result['knowledge_note']})")
    return "\n".join(lines)


def many_table(result: dict[str, Any]) -> str:
    """The readable verdicts of several candidates (:func:`judge_many_records`), one block each."""
    target = "-" if result["target_loss"] is None else f"{result['target_loss']:.4g}"
    word = objective_name(**result["objective"])
    lines = [f"target {word} {target} (the stressed run's final {word}, within {result['loss_tol']}); reached by: "
             + (", ".join(result["reached_target"]) or "none")]
    for r in result["candidates"]:
        lines += ["", f"== candidate {r['name']}", table(r)]
    return "\n".join(lines)
