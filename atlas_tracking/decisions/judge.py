"""``atlas-tracking judge``: is a candidate run a real fix of a stressed run? (docs/policy.md#the-judge)

A fix counts as real only if it improves the geometry at matched scalar quality. The judge reads
both runs' histories (:func:`~atlas_tracking.artifacts.history.read_history`), pairs gates at matched loss,
and applies the paper's four checks to the paired deltas (candidate minus stressed):

1. ``state2``: C2 (the summary, mean over routed layers) improves by more than ``policy.c2_tol``
   (and, with paired CIs, the CI of the delta lies above 0).
2. ``occupancy``: occupancy broadens on all three axes: dead experts down by more than
   ``policy.dead_tol`` (two runs that both have no dead expert pass this axis: there is nothing to
   revive), min router entropy up by more than ``policy.entropy_tol`` nats, mean load CV (x100) down by
   more than ``policy.cv_tol``; with paired CIs each CI must also exclude 0 on the broadening side.
3. ``not_state1_only``: the gain is carried by State2 or occupancy (check 1 or 2 passes), not by the
   State1 margin alone; a widened margin with neither is named as a State1-only gain.
4. ``persistence``: checks 1-3 pass together on each of the last ``policy.n_recover`` matched gates
   (a single convenient checkpoint, or a recovery followed by a relapse, fails).

Checks 1-3 are read at the latest matched gate. Matching: every candidate gate with a loss is paired
with the stressed gate of nearest loss (ties: the stressed gate nearest in step, then the earlier) when
the two losses differ by at most ``loss_tol`` (absolute, in the loss's own unit); other candidate gates
are left unpaired and listed. A stressed gate may be matched by several candidate gates.

Evidence: when both gates of a pair keep their receipts artifacts (``receipts/step_N.json`` whose
sha256 matches the record) on the same canary layout and routed layers, each delta carries the paired
window-bootstrap 95% CI (docs/receipts.md#paired-deltas: the same window resamples for both runs, the receipts
re-derived from the per-window arrays); otherwise the evidence is the point deltas of the records, and
the output says so.

Verdict: ``real fix`` (all four checks pass), ``not yet`` (names the failing checks) or
``not comparable`` (says why: different canary fingerprints, no gate at matched loss, missing receipts
fields). Records that carry no canary fingerprint at all (hand-written sequences such as the paper's
tables) are compared as given, with that caveat stated; one side with a fingerprint and one without,
or two different fingerprints, is not comparable.

Example:
    >>> stressed = [{"step": s, "loss": l, "c2": -0.03, "dead_experts": 285, "min_entropy": 2.3, "mean_cv": 190,
    ...              "margin": 0.01} for s, l in [(500, 4.7), (1000, 4.5)]]
    >>> better = [{"step": s, "loss": l, "c2": 0.02, "dead_experts": 200, "min_entropy": 2.6, "mean_cv": 160,
    ...            "margin": 0.01} for s, l in [(500, 4.71), (1000, 4.52)]]
    >>> out = judge_records(stressed, better)
    >>> out["verdict"], [c["passed"] for c in out["checks"]]
    ('real fix', [True, True, True, True])
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
from atlas_tracking.receipts.paired import occupancy_samples
from atlas_tracking.receipts.stats import bootstrap_indices, percentile_ci, ratio_samples
from atlas_tracking.schema.config import AtlasConfig

REAL_FIX, NOT_YET, NOT_COMPARABLE = "real fix", "not yet", "not comparable"
EXIT_CODES = {REAL_FIX: 0, NOT_YET: 1, NOT_COMPARABLE: 2}
CHECKS = {
    "state2": "State2 (C2) improves materially",
    "occupancy": "occupancy broadens (dead down, entropy up, CV down)",
    "not_state1_only": "the gain is not carried by State1 alone",
    "persistence": "the improvement persists across repeated gates",
}
DELTAS = ("c2", "dead_experts", "min_entropy", "mean_cv", "margin")
REQUIRED = ("c2", "dead_experts", "min_entropy", "mean_cv")
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


def _pairs(stressed: list[dict[str, Any]], candidate: list[dict[str, Any]], loss_tol: float):
    """Candidate gates paired with the stressed gate of nearest loss, within ``loss_tol``; and the unpaired."""
    pool = [s for s in stressed if finite_number(s.get("loss")) is not None]
    pairs, unpaired = [], []
    for c in candidate:
        lc = finite_number(c.get("loss"))
        if lc is None or not pool:
            if lc is not None:
                unpaired.append({"step": c["step"], "loss": lc, "why": "the stressed run has no gate with a loss"})
            continue
        best = min(pool, key=lambda s: (abs(float(s["loss"]) - lc), abs(s["step"] - c["step"]), s["step"]))
        gap = abs(float(best["loss"]) - lc)
        if gap <= loss_tol:
            pairs.append((best, c))
        else:
            unpaired.append({"step": c["step"], "loss": lc, "why": f"nearest stressed loss {best['loss']} is "
                             f"{gap:.4g} away (> {loss_tol})"})
    return pairs, unpaired


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


def _read_pair(s: dict[str, Any], c: dict[str, Any], cis: dict[str, list[float]] | None, pol) -> dict[str, Any]:
    d = {k: (None if finite_number(c.get(k)) is None or finite_number(s.get(k)) is None else float(c[k]) - float(s[k])) for k in DELTAS}
    ci = (cis or {}).get
    state2 = d["c2"] > pol.c2_tol and _inside(ci("c2"), "+")
    no_dead = float(s["dead_experts"]) == 0 and float(c["dead_experts"]) == 0
    axes = {
        "dead_experts": no_dead or (d["dead_experts"] < -pol.dead_tol and _inside(ci("dead_experts"), "-")),
        "min_entropy": d["min_entropy"] > pol.entropy_tol and _inside(ci("min_entropy"), "+"),
        "mean_cv": d["mean_cv"] < -pol.cv_tol and _inside(ci("mean_cv"), "-"),
    }
    occupancy = all(axes.values())
    return {
        "stressed_step": s["step"], "candidate_step": c["step"], "stressed_loss": finite_number(s.get("loss")),
        "candidate_loss": finite_number(c.get("loss")), "deltas": d, "ci": cis,
        "evidence": "paired window-bootstrap CIs" if cis else "point deltas",
        "state2": state2, "occupancy": occupancy, "occupancy_axes": axes,
        "margin_widened": d["margin"] is not None and d["margin"] > 0,
        "not_state1_only": state2 or occupancy,
    }


def _checks(pairs: list[dict[str, Any]], n_persist: int) -> list[dict[str, Any]]:
    last = pairs[-1]
    d = last["deltas"]
    ci = last["ci"] or {}
    at = {"stressed_step": last["stressed_step"], "candidate_step": last["candidate_step"], "evidence": last["evidence"]}
    state1 = ("only State1 moved: the margin widened while State2 and occupancy did not improve"
              if last["margin_widened"] and not last["not_state1_only"] else None)
    tail = pairs[-n_persist:]
    joint = [p["state2"] and p["occupancy"] and p["not_state1_only"] for p in tail]
    return [
        {"name": "state2", "title": CHECKS["state2"], "passed": last["state2"], **at,
         "c2_delta": d["c2"], "c2_delta_ci": ci.get("c2")},
        {"name": "occupancy", "title": CHECKS["occupancy"], "passed": last["occupancy"], **at,
         "axes": last["occupancy_axes"],
         **{f"{k}_delta": d[k] for k in ("dead_experts", "min_entropy", "mean_cv")},
         **{f"{k}_delta_ci": ci.get(k) for k in ("dead_experts", "min_entropy", "mean_cv")}},
        {"name": "not_state1_only", "title": CHECKS["not_state1_only"], "passed": last["not_state1_only"], **at,
         "margin_delta": d["margin"], "margin_delta_ci": ci.get("margin"), "note": state1},
        {"name": "persistence", "title": CHECKS["persistence"], "passed": len(tail) >= n_persist and all(joint),
         "required_gates": n_persist, "gates": [p["candidate_step"] for p in tail], "passed_at": joint,
         "note": None if len(tail) >= n_persist else f"{len(tail)} matched gate(s); persistence needs {n_persist}"},
    ]


def judge_records(stressed: list[dict[str, Any]], candidate: list[dict[str, Any]], config: AtlasConfig | None = None,
                  loss_tol: float = DEFAULT_LOSS_TOL, stressed_dir: Path | None = None,
                  candidate_dir: Path | None = None) -> dict[str, Any]:
    """The verdict on two runs' histories (see the module docstring). ``*_dir`` hold the receipts artifacts."""
    if not loss_tol >= 0:
        raise JudgeError(f"loss tolerance must be >= 0, got {loss_tol!r}")
    pol = (config or AtlasConfig()).policy
    out: dict[str, Any] = {"verdict": NOT_COMPARABLE, "reason": None, "failing": [], "checks": [], "pairs": [],
                           "unpaired": [], "loss_tol": loss_tol, "n_persist": pol.n_recover,
                           "tolerances": {k: getattr(pol, k) for k in ("c2_tol", "dead_tol", "entropy_tol", "cv_tol")}}
    fa, why_a = _fingerprint(stressed, "stressed")
    fb, why_b = _fingerprint(candidate, "candidate")
    out["canary_fingerprint"] = fb
    if why_a or why_b:
        out["reason"] = why_a or why_b
        return jsonable(out)
    if fa != fb:
        out["reason"] = (f"different canaries: stressed {fa or 'no fingerprint'}, candidate {fb or 'no fingerprint'} "
                         "(receipts are comparable only on the same canary)")
        return jsonable(out)
    if fa is None:
        out["caveat"] = "neither record carries a canary fingerprint: the runs are trusted to share one canary"
    raw, out["unpaired"] = _pairs(stressed, candidate, loss_tol)
    if not raw:
        out["reason"] = f"no candidate gate is at matched loss (within {loss_tol}) with a stressed gate"
        return jsonable(out)
    for s, c in raw:
        missing = [k for k in REQUIRED if finite_number(s.get(k)) is None or finite_number(c.get(k)) is None]
        if missing:
            out["reason"] = f"matched gates {s['step']} / {c['step']} lack {', '.join(missing)}"
            return jsonable(out)
    cis = [_paired_cis(_artifact(stressed_dir, s), _artifact(candidate_dir, c)) for s, c in raw]
    out["pairs"] = [_read_pair(s, c, ci, pol) for (s, c), ci in zip(raw, cis)]
    out["evidence"] = ("paired window-bootstrap CIs" if all(cis) else
                       "point deltas" if not any(cis) else "paired CIs on some gates, point deltas on the others")
    out["checks"] = _checks(out["pairs"], pol.n_recover)
    out["failing"] = [c["name"] for c in out["checks"] if not c["passed"]]
    out["verdict"] = NOT_YET if out["failing"] else REAL_FIX
    return jsonable(out)


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
    with ``passed`` and its numbers), ``failing``, ``reason``, the matched ``pairs`` and ``evidence``.
    Raises :class:`JudgeError` when a record cannot be read.
    """
    a, dir_a = _history(stressed, "stressed")
    b, dir_b = _history(candidate, "candidate")
    return judge_records(a, b, config, loss_tol, dir_a, dir_b)


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
            detail = f"gates {c['gates']} passed {c['passed_at']} (needs {c['required_gates']})"
        mark = "PASS" if c["passed"] else "FAIL"
        lines.append(f"  {mark}  {c['title']}: {detail}" + (f" ({c['note']})" if c.get("note") else ""))
    for p in result["pairs"]:
        lines.append(f"  pair: stressed step {p['stressed_step']} (loss {p['stressed_loss']}) / candidate step "
                     f"{p['candidate_step']} (loss {p['candidate_loss']}): C2 {_fmt(p['deltas']['c2'])}, "
                     f"dead {_fmt(p['deltas']['dead_experts'])}, {p['evidence']}")
    for u in result["unpaired"]:
        lines.append(f"  unpaired candidate step {u['step']} (loss {u['loss']}): {u['why']}")
    return "\n".join(lines)




