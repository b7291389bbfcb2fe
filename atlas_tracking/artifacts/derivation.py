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
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from threadpoolctl import ThreadpoolController

from atlas_tracking.artifacts.io import jsonable
from atlas_tracking.receipts.cliff import TERMINAL_BAND, terminal_cliff
from atlas_tracking.receipts.lifecycle import handoff_margin, refine_margin
from atlas_tracking.receipts.paired import occupancy_samples
from atlas_tracking.receipts.state1 import boundary_count
from atlas_tracking.receipts.stats import (
    bootstrap_indices,
    diff_ci,
    percentile_ci,
    ratio,
    ratio_ci,
    ratio_samples,
)
from atlas_tracking.receipts.windows import layer_receipts, summary
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
    for i, meta in enumerate(layer_meta):
        pw = per_window["layers"][i]
        values, cis = layer_receipts(
            pw, per_window["cell_counts"][i], n_windows * window, receipts_cfg["beta_pi"], idx, level
        )
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
) -> dict[str, Any]:
    """Per-layer drift, paired deltas vs the baseline, boundary concentration, and lifecycle margins."""
    n_windows = len(per_window["canary_nll"]["sum"])
    idx = bootstrap_indices(n_windows, receipts_cfg["n_bootstrap"], receipts_cfg["seed"])
    level, q = receipts_cfg["ci_level"], receipts_cfg["boundary_q"]
    out_layers = []
    delta_samples = []
    occ_samples = []
    for layer, lpw, bpw in zip(layers, per_window["layers"], base_pw["layers"]):
        entry: dict[str, Any] = {"name": layer["name"], "ordinal": layer["ordinal"], "protected": layer["protected"]}
        ci: dict[str, Any] = {}
        for name in DRIFT_RECEIPTS:
            s, c = np.asarray(lpw["drift"][name]["sum"], float), np.asarray(lpw["drift"][name]["count"], float)
            entry[name] = ratio(s, c)
            ci[name] = list(ratio_ci(s, c, idx, level))
        changed = np.asarray(lpw["drift"]["anchors_changed"], float)
        in_b = np.asarray(lpw["drift"]["anchors_changed_in_boundary"], float)
        valid = np.asarray(bpw["valid"], dtype=np.int64)
        q_eff = np.array([boundary_count(int(t), q) / t if t > 0 else 0.0 for t in valid])
        entry["boundary_change_share"] = ratio(in_b, changed)
        entry["boundary_change_null"] = ratio(changed * q_eff, changed)
        ci["boundary_change_share"] = list(ratio_ci(in_b, changed, idx, level))
        now_c2, base_c2 = lpw["c2"], bpw["c2"]
        entry["c2_delta"] = ratio(np.asarray(now_c2["sum"], float), np.asarray(now_c2["count"], float)) - ratio(
            np.asarray(base_c2["sum"], float), np.asarray(base_c2["count"], float)
        )
        ci["c2_delta"] = list(
            diff_ci(
                np.asarray(now_c2["sum"], float), np.asarray(now_c2["count"], float),
                np.asarray(base_c2["sum"], float), np.asarray(base_c2["count"], float), idx, level,
            )
        )
        delta_samples.append(
            ratio_samples(np.asarray(now_c2["sum"], float), np.asarray(now_c2["count"], float), idx)
            - ratio_samples(np.asarray(base_c2["sum"], float), np.asarray(base_c2["count"], float), idx)
        )
        occ = occupancy_samples(np.asarray(lpw["load"]), np.asarray(bpw["load"]), idx)
        occ_samples.append(occ)
        for key, now in occ["now"].items():
            diff = now - occ["base"][key]
            entry[f"{key}_delta"] = float(diff[0])
            ci[f"{key}_delta"] = list(percentile_ci(diff[1:], level))
        entry["ci"] = ci
        out_layers.append(entry)
    protected = [layer["ordinal"] for layer in layers if layer["protected"]]
    now = [layer["receipts"] for layer in layers]
    lc = lifecycle_cfg
    h, h_layer = handoff_margin(now, handoff_reference, protected, lc["lam1"], lc["lam2"], n_tokens)
    mu = (lc["mu1"], lc["mu2"], lc["mu3"])
    r, r_layer = refine_margin(now, out_layers, reference, protected, mu, lc["tau"], n_tokens)
    summary_deltas = _summary_occupancy_deltas(occ_samples, level)
    summary_deltas.update(_base_damage(per_window, base_pw, idx, level))
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
            "reference": reference,
            "handoff_reference": handoff_reference,
        }
    )


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
