"""Building a gate record from a gate's report and decision, and its tracker metrics.

The record's fields are declared in :mod:`atlas_tracking.schema.record`. A record is flat where the policy reads it (``step, c2, dead_experts, min_entropy, mean_cv,
loss, margin, resume, num_experts, layers, c2_delta_ci``), so ``atlas-tracking replay
atlas/gates.jsonl`` re-derives every decision from the local record alone; it also carries
the decision (whatever fields the policy returns), the alerts, the drift summary and its place
in the run's history (``run_id``, ``branch``, ``canary_fingerprint``; see
:mod:`atlas_tracking.artifacts.history`). ``gate_metrics`` turns a record into a bounded set of scalar
metrics for trackers.

``atlas/verdict_code`` plots the gate's one verdict (:func:`~atlas_tracking.schema.verdict.gate_verdict`: what the
report's badge and the trackers' tags show); ``atlas/status_code`` and ``atlas/stage_code`` stay the receipt-level
status and the escalation stage. ``baseline_path`` is written absolute, so it resolves wherever the record is read.

Tracker metrics carry the unit in the name: ``atlas/mean_cv_pct``, ``atlas/max_cv_pct`` (load CV x 100)
beside ``atlas/layer_NN/load_cv`` (a fraction).

Example:
    >>> rec = {"step": 10, "c2": 0.05, "dead_experts": 1.0, "min_entropy": 2.0, "mean_cv": 40.0,
    ...        "status": "GREEN", "stage": "clean", "layers": [{"ordinal": 0, "c2": 0.05, "dead_experts": 1,
    ...        "load_cv": 0.4}]}
    >>> m = gate_metrics(rec)
    >>> m["atlas/c2"], m["atlas/status_code"], m["atlas/verdict_code"], m["atlas/mean_cv_pct"], m["atlas/layer_00/load_cv"]
    (0.05, 1.0, 1.0, 40.0, 0.4)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from atlas_tracking.receipts.experts import total_loads
from atlas_tracking.schema.record import (
    BASE_DAMAGE_FIELDS,
    CLIFF_FIELDS,
    COMOVE_FIELDS,
    DELTA_FIELDS,
    DRIFT_METRICS,
    GATE_METRICS,
    LAYER_DRIFT_FIELDS,
    LAYER_FIELDS,
    LAYER_METRICS,
    METRIC_NAMES,
    RECORD_SCHEMA_VERSION,
    STAGE_CODES,
    STATUS_CODES,
    SUMMARY_METRICS,
    VERDICT_CODES,
    GateRecord,
    LayerRecord,
    Margins,
    fields,
)
from atlas_tracking.schema.verdict import gate_verdict


def finite_number(x: Any) -> float | None:
    """``x`` as a float when it is a finite number (not a bool), else None: how records are read for metrics.

    >>> finite_number(3), finite_number(float("nan")), finite_number(True), finite_number("x")
    (3.0, None, None, None)
    """
    if isinstance(x, bool) or x is None:
        return None
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def gate_record(
    report: Any,
    decision: dict[str, Any] | None,
    *,
    step: int,
    loss: float | None,
    resume: bool = False,
    baseline_path: str | None = None,
) -> GateRecord:
    """Flatten a GateReport (and the policy's decision) into one replayable JSON record."""
    s = report.summary
    drift_layers = {d["name"]: d for d in (report.drift or {}).get("layers", [])}
    windows = report.per_window.get("layers") or []
    base_windows = ((report.per_window.get("baseline") or {}).get("layers") or []) if report.drift is not None else []
    layers = []
    for i, layer in enumerate(report.layers):
        r = layer["receipts"]
        entry: LayerRecord = {
            "name": layer["name"], "index": layer["index"], "ordinal": layer["ordinal"],
            "protected": layer["protected"], "num_experts": layer.get("num_experts"), "top_k": layer.get("top_k"),
        }
        entry.update({k: r.get(k) for k in LAYER_FIELDS if k in r})  # type: ignore[misc]
        d = drift_layers.get(layer["name"])
        if d is not None:
            entry.update({k: d.get(k) for k in LAYER_DRIFT_FIELDS})  # type: ignore[misc]
        if i < len(windows) and "load" in windows[i]:
            entry["expert_load"] = total_loads(windows[i]["load"])
            if i < len(base_windows) and "load" in base_windows[i]:
                entry["expert_load_baseline"] = total_loads(base_windows[i]["load"])
        layers.append(entry)
    record: GateRecord = {
        "schema_version": RECORD_SCHEMA_VERSION,
        "step": int(step),
        "loss": finite_number(loss),
        "resume": bool(resume),
        **{k: s.get(k) for k in SUMMARY_METRICS if k in s and k != "loss"},
        "num_experts": s.get("num_experts"),
        "canary_fingerprint": report.canary["fingerprint"],
        "layers": layers,
    }
    record.update({k: s[k] for k in CLIFF_FIELDS if k in s})
    if s.get("c2_absent"):
        record["c2_absent"] = s["c2_absent"]
    if report.drift is not None:
        record.update({k: report.drift[k] for k in fields(Margins)})  # type: ignore[misc]
        record.update({k: report.drift[k] for k in DELTA_FIELDS})  # type: ignore[misc]
        record.update({k: report.drift.get(k) for k in BASE_DAMAGE_FIELDS if k in report.drift})
        record.update({k: report.drift[k] for k in COMOVE_FIELDS if k in report.drift})
        record["baseline_step"] = report.drift.get("baseline", {}).get("step")
    if baseline_path is not None:
        record["baseline_path"] = str(Path(baseline_path).resolve())  # the training process's cwd is not the reader's
    if decision is not None:
        record.update({k: v for k, v in decision.items() if k not in ("step",)})
    return record


def param_drift_metrics(drift: dict[str, Any] | None) -> dict[str, float]:
    """``atlas/param_drift/<group>`` (relative distance) and ``atlas/param_drift/<group>_moved`` (elements that
    moved) per module group and for the ``total`` (:mod:`atlas_tracking.receipts.param_drift`).

    >>> param_drift_metrics({"groups": {"experts": {"relative_distance": 0.0, "moved": 0, "count": 8}},
    ...                      "total": {"relative_distance": 0.01, "moved": 3, "count": 10}})
    {'atlas/param_drift/experts': 0.0, 'atlas/param_drift/experts_moved': 0.0, 'atlas/param_drift/total': 0.01, 'atlas/param_drift/total_moved': 3.0}
    """
    out: dict[str, float] = {}
    if not drift:
        return out
    for name, entry in [*drift.get("groups", {}).items(), ("total", drift.get("total", {}))]:
        v = finite_number(entry.get("relative_distance"))
        if v is not None:
            out[f"atlas/param_drift/{name}"] = v
        if finite_number(entry.get("moved")) is not None:
            out[f"atlas/param_drift/{name}_moved"] = float(entry["moved"])
    return out


def gate_metrics(record: GateRecord | dict[str, Any], per_layer: bool = True) -> dict[str, float]:
    """Scalar tracker metrics of a record under the ``atlas/`` namespace (bounded key count)."""
    out: dict[str, float] = {}
    for key in (*SUMMARY_METRICS, *DRIFT_METRICS, *GATE_METRICS):
        v = finite_number(record.get(key))
        if v is not None:
            out[f"atlas/{METRIC_NAMES.get(key, key)}"] = v
    if record.get("ov_cf_terminal_ordinal") is not None:
        out["atlas/ov_cf_cliff_off_terminal"] = float(record.get("ov_cf_cliff_note") is not None)
    out.update(param_drift_metrics(record.get("param_drift")))
    if record.get("status") in STATUS_CODES:
        out["atlas/status_code"] = float(STATUS_CODES[record["status"]])
    if record.get("stage") in STAGE_CODES:
        out["atlas/stage_code"] = float(STAGE_CODES[record["stage"]])
    if record.get("status") in STATUS_CODES:
        out["atlas/verdict_code"] = float(gate_verdict(record).code)
    for name, entry in (record.get("predicates") or {}).items():
        code = VERDICT_CODES.get((entry or {}).get("verdict"))
        if code is not None:
            out[f"atlas/predicate/{name}"] = float(code)
    if per_layer:
        for layer in record.get("layers", []):
            for key in LAYER_METRICS:
                v = finite_number(layer.get(key))
                if v is not None:
                    out[f"atlas/layer_{layer['ordinal']:02d}/{key}"] = v
    return out
