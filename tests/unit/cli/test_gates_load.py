"""``atlas-tracking gates`` after the gate table: the training-batch load between gates (``load.jsonl``) of a plain
loop whose first routed layer collapses between gates and recovers (:mod:`atlas_tracking.testing.planted_loop`):
the intervals and their steps, the last interval's summary against plain loops over its routes, the alarm and its
clearing with the layers in breach, the early gate as its record says; dropped routes and the overload factor from
hand-written intervals; nothing for a run without ``load.jsonl``."""

from __future__ import annotations

import json
import math

import pytest

from atlas_tracking.artifacts.history import append_line, read_history
from atlas_tracking.artifacts.load_record import read_load
from atlas_tracking.cli import main
from atlas_tracking.schema.artifacts import LOAD
from atlas_tracking.testing.planted_loop import PLANT_AT, RESTORE_AT, planted_loop


def ref_stats(load):
    """CV, max over mean, dead fraction and normalised entropy of one layer's loads, from their definitions."""
    n, total = len(load), sum(load)
    mean = total / n
    cv = math.sqrt(sum((x - mean) ** 2 for x in load) / n) / mean
    entropy = -sum(x / total * math.log(x / total) for x in load if x) / math.log(n)
    return cv, max(load) / mean, sum(1 for x in load if x == 0) / n, entropy


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = planted_loop(tmp_path_factory.mktemp("planted") / "atlas")
    return {"dir": out, "lines": read_load(out), "gates": read_history(out)}


def _collapsed_layer(lines):
    """The layer that routed to experts 0 and 1 only in every interval after the plant, up to the restore."""
    collapsed = [line for line in lines if PLANT_AT < line["first_step"] <= RESTORE_AT]
    (layer,) = [row["layer"] for row in collapsed[0]["layers"]
                if all(sum(r["load"][2:]) == 0 for line in collapsed for r in line["layers"] if r["layer"] == row["layer"])]
    return layer


def test_gates_text_has_the_load_section_after_the_table(run, capsys):
    lines, gates = run["lines"], run["gates"]
    assert main(["gates", str(run["dir"])]) == 0
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("training-batch load between gates"))
    table = out.index("") + 1  # after the last gate's verdict, where and what to do
    assert start == table + 2 + len(gates) + 1  # header, rule, one row per gate, what they cost, then the section
    assert out[start - 1].startswith(f"gate cost: {len(gates)} gates, ")
    assert out[start] == (f"training-batch load between gates: {len(lines)} interval(s), steps "
                          f"{lines[0]['first_step']}-{lines[-1]['step']}")
    last = lines[-1]
    stats = {row["layer"]: (row["name"], *ref_stats(row["load"])) for row in last["layers"]}
    worst = max(stats, key=lambda layer: stats[layer][1])
    name, cv = stats[worst][:2]
    assert out[start + 1] == (
        f"  last interval (steps {last['first_step']}-{last['step']}): worst layer {worst} ({name}): load CV "
        f"{cv:.3f}, max/mean {max(s[2] for s in stats.values()):.3f}, dead fraction max "
        f"{max(s[3] for s in stats.values()):.3f}, min normalised entropy {min(s[4] for s in stats.values()):.3f}")
    layer = _collapsed_layer(lines)
    assert out[start + 2:start + 5] == [
        "  alarms raised: 1, cleared: 1",
        f"    step 10 WARN: atlas: training-batch routing alarm at step 10 (layers in breach: {layer})",
        "    step 14 INFO: atlas: training-batch routing alarm cleared at step 14"]
    (early,) = [g for g in gates if g["trigger"] == "telemetry"]
    assert out[start + 5] == "  early gates (trigger telemetry): 1"
    assert out[start + 6].startswith(f"    step {early['step']} {early['status']} {early['stage']}: "
                                     f"{early['trigger_reason'][:80]}")
    assert early["step"] == 10 and early["stage"] == "revoked"  # the early gate read the collapsed router


def test_gates_json_has_a_load_key_with_the_same_data(run, capsys):
    lines, gates = run["lines"], run["gates"]
    assert main(["gates", str(run["dir"]), "--json"]) == 0
    load = json.loads(capsys.readouterr().out)["load"]
    assert (load["intervals"], load["first_step"], load["last_step"]) == (len(lines), 1, lines[-1]["step"])
    last = lines[-1]
    stats = {row["layer"]: ref_stats(row["load"]) for row in last["layers"]}
    worst = max(stats, key=lambda layer: stats[layer][0])
    summary = load["last"]
    assert (summary["first_step"], summary["step"], summary["worst_layer"], summary["tokens"]) == (
        last["first_step"], last["step"], worst, last["tokens"])
    assert summary["worst_layer_name"] == next(r["name"] for r in last["layers"] if r["layer"] == worst)
    for key, i, pick in (("load_cv_max", 0, max), ("max_over_mean", 1, max), ("dead_fraction_max", 2, max),
                         ("entropy_min", 3, min)):
        assert summary[key] == pytest.approx(pick(s[i] for s in stats.values()), rel=1e-12), key
    assert "dropped_fraction" not in summary and "overload_factor" not in summary
    assert (summary["alarm"], summary["breach_layers"]) == (0, 0)
    assert [(a["step"], a["level"], a["key"], a["layers"]) for a in load["alerts"]] == [
        (10, "WARN", "telemetry:alarm", [_collapsed_layer(lines)]), (14, "INFO", "telemetry:cleared", [])]
    assert load["alerts"][0]["text"] == next(line for line in lines if line["step"] == 10)["alerts"][0]["text"]
    (early,) = [g for g in gates if g["trigger"] == "telemetry"]
    assert load["early_gates"] == [{"step": early["step"], "status": early["status"], "stage": early["stage"],
                                    "trigger_reason": early["trigger_reason"]}]
    assert load["uncounted"] == []


def test_dropped_routes_and_overload_factor_from_hand_written_intervals(tmp_path, capsys):
    """A capacity limit on one layer (dropped routes) and expert parallelism over two processes (``ep_tokens``)."""
    append_line(tmp_path / "gates.jsonl", {"step": 0, "branch": "a", "status": "BASELINE", "stage": "baseline",
                                           "trigger": "start"})
    layers = [{"layer": 3, "name": "l3", "load": [30, 10, 0, 0], "dropped": 4, "ep_tokens": [36, 4]},
              {"layer": 5, "name": "l5", "load": [10, 10, 10, 10], "dropped": None, "ep_tokens": [22, 18]}]
    append_line(tmp_path / LOAD, {"step": 4, "first_step": 1, "tokens": 20, "layers": layers, "branch": "a",
                           "uncounted": [1, 2]})
    assert main(["gates", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    cv = ref_stats([30, 10, 0, 0])[0]
    overload = max(36 / 20, 22 / 20)
    assert (f"worst layer 3 (l3): load CV {cv:.3f}, max/mean 3.000, dead fraction max 0.500, min normalised "
            f"entropy {ref_stats([30, 10, 0, 0])[3]:.3f}, dropped fraction {4 / 40:.3f}, overload factor "
            f"{overload:.3f}") in text
    assert "steps 1-2: no interval holds their routes" in text
    assert "alarms raised: 0" in text and "early gates (trigger telemetry): 0" in text
    assert main(["gates", str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["load"]["last"]
    assert summary["dropped_fraction"] == pytest.approx(0.1) and summary["overload_factor"] == pytest.approx(overload)


def test_a_run_without_load_jsonl_has_no_section(tmp_path, capsys):
    append_line(tmp_path / "gates.jsonl", {"step": 0, "branch": "a", "status": "BASELINE", "stage": "baseline"})
    assert main(["gates", str(tmp_path)]) == 0
    assert "training-batch load" not in capsys.readouterr().out
    assert main(["gates", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["load"] is None


def test_intervals_of_the_first_load_version_are_named_as_counting_passes_without_gradients(tmp_path, capsys):
    """Version 1 of ``load.jsonl`` also counted training-mode passes without gradients; a history that holds its
    intervals (a run resumed across versions) says which steps they cover, in the text, the JSON and the report."""
    from atlas_tracking.viz.html_report import load_section

    append_line(tmp_path / "gates.jsonl", {"step": 0, "branch": "a", "status": "BASELINE", "stage": "baseline",
                                           "trigger": "start"})
    layers = [{"layer": 1, "name": "l1", "load": [4, 4, 4, 4]}]
    lines = [{"schema_version": version, "step": step, "first_step": step - 3, "tokens": 8, "layers": layers,
              "branch": "a"} for version, step in ((1, 4), (1, 8), (2, 12))]
    for line in lines:
        append_line(tmp_path / LOAD, line)
    said = ("2 interval(s) of steps 1-8 were written by load.jsonl version 1, which also counted training-mode passes "
            "without gradients")
    assert main(["gates", str(tmp_path)]) == 0
    assert said in capsys.readouterr().out
    assert main(["gates", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["load"]["counted_no_grad"] == [[1, 4], [5, 8]]
    assert said in load_section(lines, [{"step": 0, "trigger": "start"}])[0]
    append_line(tmp_path / "current" / LOAD, lines[-1])                  # the current version alone: nothing said
    append_line(tmp_path / "current" / "gates.jsonl", {"step": 0, "branch": "a", "status": "BASELINE"})
    assert main(["gates", str(tmp_path / "current")]) == 0
    assert "version 1" not in capsys.readouterr().out


@pytest.mark.parametrize("name", [LOAD, "rollout.jsonl"])
def test_a_line_of_a_newer_version_is_refused_by_name(tmp_path, capsys, name):
    """A ``load.jsonl`` or ``rollout.jsonl`` line written by a later atlas_tracking is never read as this version's."""
    from atlas_tracking.artifacts.history import HistoryError
    from atlas_tracking.artifacts.rollout_record import read_rollout
    from atlas_tracking.cli.common import EXIT_ERROR
    from atlas_tracking.schema.load import LOAD_SCHEMA_VERSION
    from atlas_tracking.schema.rollout import ROLLOUT_SCHEMA_VERSION

    newest, read = (LOAD_SCHEMA_VERSION, read_load) if name == LOAD else (ROLLOUT_SCHEMA_VERSION, read_rollout)
    append_line(tmp_path / "gates.jsonl", {"step": 0, "branch": "a", "status": "BASELINE", "stage": "baseline"})
    append_line(tmp_path / name, {"schema_version": newest, "step": 4, "first_step": 1, "tokens": 8, "layers": [],
                                  "branch": "a"})
    assert len(read(tmp_path)) == 1
    append_line(tmp_path / name, {"schema_version": newest + 1, "step": 8, "first_step": 5, "branch": "a"})
    with pytest.raises(HistoryError, match=rf"{name}: the .* at step 8 has schema_version {newest + 1}; this "
                                           rf"atlas_tracking reads versions <= {newest}"):
        read(tmp_path)
    command = ["gates", str(tmp_path)] if name == LOAD else ["report", str(tmp_path), "--out", str(tmp_path / "r.html")]
    assert main(command) == EXIT_ERROR
    assert f"has schema_version {newest + 1}; this atlas_tracking reads" in capsys.readouterr().err
