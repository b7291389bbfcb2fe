"""Receipts from per-window arrays: the derivation shared by ``measure`` (at a gate) and ``verify``.

``derive`` turns a gate's per-window sums and counts into every layer's receipts, their window-bootstrap CIs
and the cross-layer summary; ``derive_drift`` adds the drift functionals, the paired deltas against a
baseline, base-domain damage and the lifecycle margins. Both are pure host statistics, run on one BLAS
thread: numpy's OpenBLAS keeps its worker threads spinning after a multi-threaded call, and on a training host
they compete with the framework's own threads (on a 2-core machine a forward right after a gate's bootstrap
took twice as long), while a gate's host products are small (resamples x windows).

Example:
    >>> @one_blas_thread
    ... def gram(a):
    ...     return a @ a.T
    >>> gram(np.eye(2)).tolist()
    [[1.0, 0.0], [0.0, 1.0]]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from threadpoolctl import ThreadpoolController

from atlas_tracking.artifacts.io import jsonable
from atlas_tracking.receipts.cliff import TERMINAL_BAND, terminal_cliff
from atlas_tracking.receipts.coupling import COMOVE_PARTS, comovement_receipts
from atlas_tracking.receipts.lifecycle import handoff_margin, refine_margin
from atlas_tracking.receipts.paired import occupancy_samples
from atlas_tracking.receipts.state1 import boundary_count
from atlas_tracking.receipts.stats import (
    bootstrap_indices,
    diff_ci,
    float_multiplicity,
    percentile_ci,
    percentile_cis,
    pooled_ratios,
    ratio,
    ratio_ci,
    ratio_sample_matrix,
    ratio_samples,
)
from atlas_tracking.receipts.windows import layers_receipts, summary
from atlas_tracking.schema.artifacts import DRIFT_RECEIPTS

F = TypeVar("F", bound=Callable)


@functools.lru_cache(maxsize=1)
def _controller() -> ThreadpoolController:
    return ThreadpoolController()


def one_blas_thread(fn: F) -> F:
    """Run ``fn`` with every loaded BLAS library limited to one thread (restored afterwards)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _controller().limit(limits=1, user_api="blas"):
            return fn(*args, **kwargs)

    return wrapped  # type: ignore[return-value]


@one_blas_thread
def derive(
    layer_meta: list[dict[str, Any]],
    per_window: dict[str, Any],
    n_windows: int,
    window: int,
    receipts_cfg: dict[str, Any],
    exact: list[dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Layers (meta + receipts + CIs) and the summary (State3 included) from per-window arrays.

    ``exact`` carries per-layer receipts that need per-token values (margin quantiles);
    they are copied through, not re-derived.
    """
    idx = bootstrap_indices(n_windows, receipts_cfg["n_bootstrap"], receipts_cfg["seed"])
    level = receipts_cfg["ci_level"]
    layers = []
    every = range(len(layer_meta))  # an artifact with fewer per-window layers than layers raises, as verify reads it
    derived = layers_receipts([per_window["layers"][i] for i in every], [per_window["cell_counts"][i] for i in every],
                              n_windows * window, receipts_cfg["beta_pi"], idx, level)
    for i, (meta, (values, cis)) in enumerate(zip(layer_meta, derived)):
        if exact is not None:
            values.update(exact[i])
        layers.append({**meta, "receipts": values, "ci": cis})
    nll = per_window["canary_nll"]
    s, c = np.asarray(nll["sum"], float), np.asarray(nll["count"], float)
    summ = summary(layers, jsonable(ratio(s, c)))
    summ["canary_nll_ci"] = list(ratio_ci(s, c, idx, level))
    depth = sorted(range(len(layer_meta)), key=lambda i: layer_meta[i].get("ordinal", i))
    summ.update(terminal_cliff([per_window["layers"][i]["ov_cf"] for i in depth], idx, level,
                               receipts_cfg.get("terminal_band", TERMINAL_BAND)))
    return layers, jsonable(summ)


@one_blas_thread
def derive_drift(
    layers: list[dict[str, Any]],
    per_window: dict[str, Any],
    base_pw: dict[str, Any],
    reference: list[dict[str, Any]],
    handoff_reference: list[dict[str, Any]],
    n_tokens: int,
    receipts_cfg: dict[str, Any],
    lifecycle_cfg: dict[str, Any],
    base: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Per-layer drift, paired deltas vs the baseline, boundary concentration, and lifecycle margins.

    ``base`` is the post-training base (``step``, per-layer ``reference``, and its per-window ``canary_nll``, None
    when the base is the baseline itself): the refinement margin's occupancy ratio reads against it, and the base
    damage since the base (``kl_base_cumulative``, ``canary_nll_delta_cumulative``) is derived beside the damage
    since the baseline (docs/receipts.md#base-domain-damage).
    """
    n_windows = len(per_window["canary_nll"]["sum"])
    idx = bootstrap_indices(n_windows, receipts_cfg["n_bootstrap"], receipts_cfg["seed"])
    level, q = receipts_cfg["ci_level"], receipts_cfg["boundary_q"]
    out_layers, delta_samples, occ_samples = _layer_drift(layers, per_window["layers"], base_pw["layers"], idx, level,
                                                          q)
    protected = [layer["ordinal"] for layer in layers if layer["protected"]]
    now = [layer["receipts"] for layer in layers]
    lc = lifecycle_cfg
    h, h_layer = handoff_margin(now, handoff_reference, protected, lc["lam1"], lc["lam2"], n_tokens)
    mu = (lc["mu1"], lc["mu2"], lc["mu3"])
    since_base = base is not None and base.get("canary_nll") is not None
    refine_drift = _drift_since_base(per_window) if since_base else None
    refine_ref = base["reference"] if base else reference
    r, r_layer = refine_margin(now, refine_drift or out_layers, refine_ref, protected, mu, lc["tau"], n_tokens)
    r_ci = _refine_ci(per_window, "drift_base" if refine_drift else "drift", refine_ref, protected, lc, n_tokens,
                      idx, level)
    summary_deltas = _summary_occupancy_deltas(occ_samples, level)
    summary_deltas.update(_comovement_summary(out_layers))
    summary_deltas.update(_base_damage(per_window, base_pw, idx, level))
    if base is not None:
        summary_deltas.update(_cumulative_damage(per_window, base, summary_deltas, idx, level))
    return jsonable(
        {
            "layers": out_layers,
            "c2_delta": float(np.mean([d["c2_delta"] for d in out_layers])),
            "c2_delta_ci": list(percentile_ci(np.mean(delta_samples, axis=0), level)),
            **summary_deltas,
            "handoff_margin": h,
            "handoff_layer": layers[h_layer]["name"],
            "refine_margin": r,
            "refine_layer": layers[r_layer]["name"],
            "refine_margin_ci": r_ci,
            "refine_reference": _refine_reference(base, refine_drift is not None),
            "reference": reference,
            "handoff_reference": handoff_reference,
            **({"base": base} if base is not None else {}),
        }
    )


def _layer_drift(layers: list[dict[str, Any]], now_pw: list[dict[str, Any]], base_pw: list[dict[str, Any]],
                 idx: np.ndarray, level: float, q: float) -> tuple[list[dict[str, Any]], list[np.ndarray], list[dict]]:
    """Per layer against the baseline: the drift functionals, the boundary concentration of the changed anchors, the
    C2 delta and the occupancy deltas, each with its window-bootstrap CI; with each layer's resampled C2 deltas and
    occupancy statistics (for the summaries). Every layer's ratios are resampled in one product and every CI is taken
    in one quantile call."""
    ratios = []  # (sums, counts) per layer: the drift functionals, the boundary share, C2 now, C2 at the baseline
    for lpw, bpw in zip(now_pw, base_pw):
        drift = lpw["drift"]
        ratios += [(drift[name]["sum"], drift[name]["count"]) for name in DRIFT_RECEIPTS]
        ratios += [(drift["anchors_changed_in_boundary"], drift["anchors_changed"]),
                   (lpw["c2"]["sum"], lpw["c2"]["count"]), (bpw["c2"]["sum"], bpw["c2"]["count"])]
    per_layer = len(DRIFT_RECEIPTS) + 3
    sums, counts = (np.array([np.asarray(r[part], float) for r in ratios]).reshape(len(ratios), -1) for part in (0, 1))
    pooled = pooled_ratios(sums, counts).tolist() if ratios else []
    samples = ratio_sample_matrix(sums, counts, idx) if ratios else np.zeros((len(idx), 0))
    columns, entries, delta_samples, occ_samples = [], [], [], []
    for i, (layer, lpw, bpw) in enumerate(zip(layers, now_pw, base_pw)):
        j = i * per_layer
        entry: dict[str, Any] = {"name": layer["name"], "ordinal": layer["ordinal"], "protected": layer["protected"]}
        names = [*DRIFT_RECEIPTS, "boundary_change_share"]
        entry.update(zip(DRIFT_RECEIPTS, pooled[j : j + len(DRIFT_RECEIPTS)]))
        changed = np.asarray(lpw["drift"]["anchors_changed"], float)
        valid = np.asarray(bpw["valid"], dtype=np.int64)
        q_eff = np.array([boundary_count(int(t), q) / t if t > 0 else 0.0 for t in valid])
        entry["boundary_change_share"] = pooled[j + len(DRIFT_RECEIPTS)]
        entry["boundary_change_null"] = ratio(changed * q_eff, changed)
        entry["c2_delta"] = pooled[j + per_layer - 2] - pooled[j + per_layer - 1]
        delta_samples.append(samples[:, j + per_layer - 2] - samples[:, j + per_layer - 1])
        layer_columns = [samples[:, j + c] for c in range(len(names))] + [delta_samples[-1]]
        names.append("c2_delta")
        occ = occupancy_samples(np.asarray(lpw["load"]), np.asarray(bpw["load"]), idx)
        occ_samples.append(occ)
        for key in occ["now"]:
            diff = occ["now"][key] - occ["base"][key]
            entry[f"{key}_delta"] = float(diff[0])
            layer_columns.append(diff[1:])
            names.append(f"{key}_delta")
        if "comove" in lpw:
            entry.update(_comovement(lpw["comove"]))
        columns += layer_columns
        entries.append((entry, names))
    bounds = iter(percentile_cis(np.column_stack(columns), level).tolist() if columns else [])
    out_layers = []
    for entry, names in entries:
        entry["ci"] = {name: next(bounds) for name in names}
        out_layers.append(entry)
    return out_layers, delta_samples, occ_samples


def _comovement(comove: dict[str, Any]) -> dict[str, Any]:
    """A layer's co-movement against the baseline from its per-expert sums, or why it has none
    (docs/receipts.md#co-movement)."""
    if "absent" in comove:
        return {"comove_absent": comove["absent"]}
    return comovement_receipts(comove)


def _comovement_summary(out_layers: list[dict[str, Any]]) -> dict[str, Any]:
    """Across the routed layers: the mean of the layers' co-movement medians and shares against, the experts compared
    and the experts whose router row did not move (None and 0 where no layer compared any)."""
    out: dict[str, Any] = {}
    for part in COMOVE_PARTS:
        for key in (f"comove_{part}", f"comove_{part}_against"):
            vals = [d[key] for d in out_layers if d.get(key) is not None]
            out[key] = float(np.mean(vals)) if vals else None
    out["comove_compared"] = int(sum(d.get("comove_state_compared", 0) for d in out_layers))
    out["comove_router_still"] = int(sum(d.get("comove_router_still", 0) for d in out_layers))
    return out


def _summary_occupancy_deltas(occ_samples: list[dict[str, Any]], level: float) -> dict[str, Any]:
    """Paired deltas of the policy's summaries: mean dead experts, min entropy, mean CV (x100)."""
    def agg(side: str) -> dict[str, np.ndarray]:
        return {
            "dead_experts": np.mean([o[side]["dead_experts"] for o in occ_samples], axis=0),
            "min_entropy": np.min([o[side]["router_entropy"] for o in occ_samples], axis=0),
            "mean_cv": 100.0 * np.mean([o[side]["load_cv"] for o in occ_samples], axis=0),
        }

    now, base = agg("now"), agg("base")
    out: dict[str, Any] = {}
    for key in now:
        diff = now[key] - base[key]
        out[f"{key}_delta"] = float(diff[0])
        out[f"{key}_delta_ci"] = list(percentile_ci(diff[1:], level))
    return out


def _refine_ci(per_window: dict[str, Any], drift_key: str, reference: list[dict[str, Any]], protected: list[int],
               lc: dict[str, Any], n_tokens: int, idx: np.ndarray, level: float) -> list[float]:
    """Window-bootstrap CI of the refinement margin: each resample re-counts the protected layers' boundary and
    content drift and their expert loads (so ``pi_min``) on the same windows; the reference's ``pi_min`` is fixed."""
    eps = 1.0 / n_tokens
    worst: np.ndarray | None = None
    for i in protected:
        lpw = per_window["layers"][i]
        bd, cd = (ratio_samples(np.asarray(lpw[drift_key][name]["sum"], float),
                                np.asarray(lpw[drift_key][name]["count"], float), idx)
                  for name in ("boundary_drift", "content_drift"))
        loads = float_multiplicity(idx, len(lpw["load"])) @ np.asarray(lpw["load"], np.float64)
        rho = (loads.min(axis=1) / n_tokens + eps) / (reference[i]["pi_min"] + eps)
        term = lc["mu1"] * bd + lc["mu2"] * cd + lc["mu3"] * (1.0 - rho)
        worst = term if worst is None else np.fmax(worst, term)
    if worst is None:
        return [math.nan, math.nan]
    return list(percentile_ci(lc["tau"] - worst, level))


def _drift_since_base(per_window: dict[str, Any]) -> list[dict[str, float]] | None:
    """Per layer, the boundary and content drift against the post-training base's anchors (None when the gate
    did not measure them: the base's anchors sit at other positions)."""
    if any("drift_base" not in lpw for lpw in per_window["layers"]):
        return None
    out = []
    for lpw in per_window["layers"]:
        d = lpw["drift_base"]
        out.append({name: ratio(np.asarray(d[name]["sum"], float), np.asarray(d[name]["count"], float))
                    for name in ("boundary_drift", "content_drift")})
    return out


def _refine_reference(base: dict[str, Any] | None, drift_since_base: bool) -> str:
    """What the refinement margin read against, in words (the record's ``refine_reference``)."""
    if base is None:
        return "the baseline"
    if base.get("canary_nll") is None or drift_since_base:
        return f"the post-training base (step {base.get('step')})"
    return (f"occupancy against the post-training base (step {base.get('step')}), drift since the baseline (the base's "
            "anchors sit at other positions)")


def _cumulative_damage(per_window: dict[str, Any], base: dict[str, Any], since_baseline: dict[str, Any],
                       idx: np.ndarray, level: float) -> dict[str, Any]:
    """The base damage since the post-training base: ``kl_base_cumulative`` from the KL against the base's
    log-probabilities (``per_window["kl_cumulative"]``) and ``canary_nll_delta_cumulative`` paired against the
    base's per-window canary NLL; when the base is the baseline (``base["canary_nll"]`` None) they are the
    damage since the baseline."""
    out: dict[str, Any] = {"base_step": base.get("step")}
    if base.get("canary_nll") is None:
        return {**out, **{f"{key}_cumulative{ci}": since_baseline.get(f"{key}{ci}")
                          for key in ("kl_base", "canary_nll_delta") for ci in ("", "_ci")}}
    damage = _base_damage({"canary_nll": per_window["canary_nll"], "kl_base": per_window.get("kl_cumulative")},
                          {"canary_nll": base["canary_nll"]}, idx, level)
    return {**out, **{f"{key}_cumulative{ci}": damage[f"{key}{ci}"]
                      for key in ("kl_base", "canary_nll_delta") for ci in ("", "_ci")}}


def _base_damage(per_window: dict[str, Any], base_pw: dict[str, Any], idx: np.ndarray, level: float) -> dict[str, Any]:
    """``kl_base`` (token-weighted mean KL(base || now)) with its window-bootstrap CI (None without the
    base top-K), and ``canary_nll_delta`` (now minus base) with its paired CI."""
    out: dict[str, Any] = {"kl_base": None, "kl_base_ci": None}
    kl = per_window.get("kl_base")
    if kl is not None:
        s, c = np.asarray(kl["sum"], float), np.asarray(kl["count"], float)
        out["kl_base"], out["kl_base_ci"] = ratio(s, c), list(ratio_ci(s, c, idx, level))
    now, base = per_window["canary_nll"], base_pw["canary_nll"]
    arrays = [np.asarray(a, float) for a in (now["sum"], now["count"], base["sum"], base["count"])]
    out["canary_nll_delta"] = ratio(arrays[0], arrays[1]) - ratio(arrays[2], arrays[3])
    out["canary_nll_delta_ci"] = list(diff_ci(*arrays, idx, level))
    return out
