"""The record schema: one declaration, the enums' codes, and the reader of older records."""

from __future__ import annotations

import dataclasses
import json

import pytest

from atlas_tracking.artifacts.history import HistoryError, append_line, read_history
from atlas_tracking.decisions.policy import GateDecision
from atlas_tracking.decisions.replay import replay
from atlas_tracking.schema import record as schema


def test_the_policys_decision_is_the_records_decision_section():
    assert GateDecision is schema.GateDecision
    assert [f.name for f in dataclasses.fields(GateDecision)][1:] == list(schema.DECISION_FIELDS)
    assert set(schema.DECISION_FIELDS) <= set(schema.RECORD_FIELDS)


def test_status_and_stage_codes_are_the_tracker_codes():
    assert schema.STATUS_CODES == {"BASELINE": 0, "GREEN": 1, "YELLOW": 2, "RED": 3}
    assert schema.STAGE_CODES == {"baseline": 0, "clean": 1, "recovering": 2, "revoked": 3, "alert": 4, "prepare": 5,
                                  "intervene": 6, "forming": 7, "ready": 8, "collapse": 9, "stable": 10}
    assert json.dumps({"status": schema.Status.GREEN, "stage": schema.Stage.clean}) == \
        '{"status": "GREEN", "stage": "clean"}'
    assert f"{schema.Stage.intervene}" == "intervene" and schema.Status("RED") is schema.Status.RED


def test_field_lists_are_derived_from_the_declaration():
    assert set(schema.SUMMARY_METRICS) <= set(schema.fields(schema.Summary))
    assert set(schema.LAYER_METRICS) <= set(schema.fields(schema.LayerRecord))
    assert schema.METRIC_NAMES == {"mean_cv": "mean_cv_pct", "max_cv": "max_cv_pct"}
    assert schema.LAYER_DRIFT_FIELDS == ("coord_drift", "boundary_drift", "transition_drift", "content_drift",
                                         "c2_delta", "dead_experts_delta", "comove_state", "comove_state_against",
                                         "comove_field", "comove_field_against", "comove_router_still", "comove_absent")
    # the base-damage keys verify checks are the declared ones, less the reason of an absence
    from atlas_tracking.schema.artifacts import BASE_DAMAGE_KEYS
    assert set(BASE_DAMAGE_KEYS) | {"kl_base_absent"} == set(schema.BASE_DAMAGE_FIELDS)


V1 = [  # two gates as version 1 wrote them: no schema_version
    {"step": 0, "c2": 0.08, "dead_experts": 42, "min_entropy": 3.0, "mean_cv": 140, "loss": None, "status": "BASELINE",
     "stage": "baseline"},
    {"step": 500, "c2": -0.03, "dead_experts": 285, "min_entropy": 2.3, "mean_cv": 190, "loss": 4.7,
     "status": "YELLOW", "stage": "revoked"},
]


def test_a_version_1_record_is_read_as_version_2(tmp_path):
    for rec in V1:
        append_line(tmp_path / "gates.jsonl", rec)
    history = read_history(tmp_path)
    assert [r["schema_version"] for r in history] == [2, 2]
    assert [{k: v for k, v in r.items() if k != "schema_version"} for r in history] == V1
    assert [(d["status"], d["stage"]) for d in replay(history)] == [("BASELINE", "baseline"), ("YELLOW", "revoked")]


def test_a_newer_record_is_an_error_naming_both_versions(tmp_path):
    append_line(tmp_path / "gates.jsonl", {**V1[0], "schema_version": 3})
    with pytest.raises(HistoryError, match="schema_version 3; this atlas_tracking reads versions <= 2"):
        read_history(tmp_path)
