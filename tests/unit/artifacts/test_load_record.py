"""``load.jsonl`` (artifacts/load_record.py): appended and read back, a torn last line skipped with one warning and
cut at the next append; one history across resumes (random sequences of intervals and resumes from any
checkpoint, abandoned branches included, against a reference written from the segments' definition: nothing is
ever lost), and ``RunDir.rewind`` rebuilding ``alerts.jsonl`` with the history's interval alerts."""

from __future__ import annotations

import hashlib
import json
import logging

from hypothesis import given, settings
from hypothesis import strategies as st

from atlas_tracking.artifacts.history import append_line, read_lines
from atlas_tracking.artifacts.load_record import load_file, read_load, rewind_load
from atlas_tracking.artifacts.run_dir import RunDir
from atlas_tracking.schema.artifacts import LOAD, LOAD_ABANDONED


def _interval(step, branch, **extra):
    return {"schema_version": 2, "step": step, "first_step": step - 9, "tokens": 64, "branch": branch,
            "layers": [{"layer": 0, "name": "model.layers.0.mlp", "load": [step, 3, 0, 1], "dropped": None,
                        "tokens": 64, "calls": 2, "processes": 1}], **extra}


def test_append_and_read_back(tmp_path):
    lines = [_interval(s, "a") for s in (10, 20, 30)]
    for line in lines:
        append_line(tmp_path / LOAD, line)
    assert read_load(tmp_path) == lines
    assert [json.loads(x) for x in (tmp_path / LOAD).read_text().splitlines()] == lines
    # a Lightning root holds the record under atlas/
    assert read_load(tmp_path.parent) == [] and load_file(tmp_path / "x") == tmp_path / "x"
    nested = tmp_path / "root"
    append_line(nested / "atlas" / LOAD, lines[0])
    assert read_load(nested) == [lines[0]] and load_file(nested) == nested / "atlas" / LOAD


def test_a_torn_last_line_is_skipped_with_a_warning_and_cut_at_the_next_append(tmp_path, caplog):
    lines = [_interval(s, "a") for s in (10, 20)]
    for line in lines:
        append_line(tmp_path / LOAD, line)
    whole = json.dumps(_interval(30, "a"), separators=(",", ":"))
    with (tmp_path / LOAD).open("a") as fh:  # a crash in the middle of the third append
        fh.write(whole[: len(whole) // 2])
    with caplog.at_level(logging.WARNING, logger="atlas_tracking"):
        assert read_load(tmp_path) == lines
    torn = [r for r in caplog.records if "cut short" in r.getMessage()]
    assert len(torn) == 1 and "interval" in torn[0].getMessage() and "30" in torn[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="atlas_tracking"):
        append_line(tmp_path / LOAD, _interval(40, "a"))  # cuts the torn line off first, and says so
        assert [r.getMessage().count("removed") for r in caplog.records] == [1]
        caplog.clear()
        assert read_load(tmp_path) == [*lines, _interval(40, "a")]
    assert not caplog.records
    assert (tmp_path / LOAD).read_text().count("\n") == 3 and '"step":30' not in (tmp_path / LOAD).read_text()


# --- one history across resumes ----------------------------------------------------------------------------------


def ref_history(written, segments, step):
    """The intervals of a state restored at ``step`` with ``segments``: those a segment's branch wrote from its
    first step up to the next segment's first step (exclusive), the last segment up to ``step``."""
    keep = []
    for line in written:
        for i in range(len(segments)):
            branch, first = segments[i]
            last = segments[i + 1][1] - 1 if i + 1 < len(segments) else step
            if line["branch"] == branch and first <= line["step"] <= last:
                keep.append(line)
                break
    return sorted(keep, key=lambda x: x["step"])


def _keys(lines):
    return sorted((x["step"], x["branch"]) for x in lines)


class Run:
    """A training run as the telemetry keeps it: intervals of any length appended on the current branch, a
    checkpoint (the step, its segments) after every optimizer step, resumes from any checkpoint on a new branch."""

    def __init__(self, path):
        self.path = path
        self.branch, self.step, self.segments = "b0", 0, [["b0", 1]]
        self.written, self.checkpoints = [], []

    def train(self, lengths):
        for length in lengths:
            for i in range(length):
                self.step += 1
                if i == length - 1:  # the interval closes, then the checkpoint of that step is saved
                    line = _interval(self.step, self.branch)
                    append_line(self.path / LOAD, line)
                    self.written.append(line)
                self.checkpoints.append((self.step, [list(s) for s in self.segments]))

    def resume(self, checkpoint):
        step, segments = self.checkpoints[checkpoint]
        moved = rewind_load(self.path, step, segments)
        self.branch = f"b{len(self.checkpoints)}x{checkpoint}"
        self.step, self.segments = step, [*segments, [self.branch, step + 1]]
        return step, segments, moved

    def check(self, step, segments):
        live, parked = read_lines(self.path / LOAD), read_lines(self.path / LOAD_ABANDONED)
        assert live == ref_history(self.written, segments, step)
        assert _keys(live + parked) == _keys(self.written)  # nothing lost, nothing twice


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 3), min_size=1, max_size=4), st.integers(0, 10**6)),
                min_size=1, max_size=6))
def test_resumes_from_any_checkpoint_keep_one_history_and_lose_nothing(tmp_path_factory, plan):
    run = Run(tmp_path_factory.mktemp("run"))
    for lengths, pick in plan:
        run.train(lengths)
        step, segments, moved = run.resume(pick % len(run.checkpoints))
        run.check(step, segments)
        assert isinstance(moved, int) and moved >= 0
        assert rewind_load(run.path, step, segments) == 0  # settled: a second rewind moves nothing
        assert all(x["step"] <= step for x in read_load(run.path))


def test_an_abandoned_branch_comes_back_when_resumed_from_its_checkpoint(tmp_path):
    run = Run(tmp_path)
    run.train([10] * 5)  # b0: intervals at 10..50, a checkpoint at every step
    assert run.resume(19)[2] == 3  # back to step 20: 30, 40, 50 of b0 move aside
    assert [x["step"] for x in read_load(tmp_path)] == [10, 20]
    assert [x["step"] for x in read_lines(tmp_path / LOAD_ABANDONED)] == [30, 40, 50]
    run.train([10, 10])  # the new branch writes 30, 40
    assert run.resume(49)[2] == 5  # b0's checkpoint at 50: b0's 30-50 back, the new branch's 30, 40 aside
    assert _keys(read_load(tmp_path)) == [(s, "b0") for s in (10, 20, 30, 40, 50)]
    assert _keys(read_lines(tmp_path / LOAD_ABANDONED)) == [(30, "b50x19"), (40, "b50x19")]
    # a state saved without segments: the file's intervals after its step move aside, those aside stay there
    assert rewind_load(tmp_path, 30, None) == 2
    assert _keys(read_load(tmp_path)) == [(10, "b0"), (20, "b0"), (30, "b0")]
    assert _keys(read_lines(tmp_path / LOAD_ABANDONED)) == [(30, "b50x19"), (40, "b0"), (40, "b50x19"), (50, "b0")]
    assert rewind_load(tmp_path.parent / "empty", 30, None) == 0


# --- RunDir.rewind: the alerts file follows the history -----------------------------------------------------------


def _gate(run: RunDir, step, branch, alerts=()):
    text = f"receipts {step} {branch}"
    run.receipts.mkdir(parents=True, exist_ok=True)
    run.receipts_file(step).write_text(text)
    rec = {"step": step, "branch": branch, "receipts_sha256": hashlib.sha256(text.encode()).hexdigest(),
           "alerts": list(alerts)}
    append_line(run.gates, rec)
    for alert in alerts:
        append_line(run.alerts, alert)
    return rec


def _alert(step, key, branch):
    return {"title": f"{key} {branch} {step}", "text": "", "level": "WARN", "key": key, "step": step,
            "wait_duration_s": 300.0}


def test_run_dir_rewind_rebuilds_the_alerts_with_the_intervals_alerts(tmp_path):
    run = RunDir(tmp_path)

    def interval(step, branch, alerting):
        alerts = [_alert(step, "telemetry:alarm", branch)] if alerting else []
        append_line(tmp_path / LOAD, _interval(step, branch, alerts=alerts))
        for alert in alerts:
            append_line(run.alerts, alert)

    _gate(run, 0, "a")
    interval(10, "a", True)
    _gate(run, 20, "a", [_alert(20, "stage:revoked", "a")])
    interval(30, "a", False)
    interval(40, "a", True)
    _gate(run, 40, "a")
    # resume from the checkpoint at step 20 on branch b: a's interval alert at 40 leaves with its interval
    run.rewind(20, lineage=[[0, "a"], [20, "a"]], branch="a", load_segments=[["a", 1]])
    assert [(a["step"], a["key"]) for a in read_lines(run.alerts)] == [(10, "telemetry:alarm"), (20, "stage:revoked")]
    interval(30, "b", True)
    _gate(run, 40, "b")
    # back to a's checkpoint at 40: a's intervals and their alert return, b's leave
    run.rewind(40, lineage=[[0, "a"], [20, "a"], [40, "a"]], branch="a", load_segments=[["a", 1]])
    assert [(a["step"], a["title"]) for a in read_lines(run.alerts)] == [
        (10, "telemetry:alarm a 10"), (20, "stage:revoked a 20"), (40, "telemetry:alarm a 40")]
    assert _keys(read_load(tmp_path)) == [(10, "a"), (30, "a"), (40, "a")]
    assert _keys(read_lines(tmp_path / LOAD_ABANDONED)) == [(30, "b")]
