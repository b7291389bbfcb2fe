"""One true history per run (issue 17, items 1 and 2): resumes from older checkpoints, fresh runs in a used
directory, canary changes; in a Lightning fit and in a plain AtlasGate loop."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from atlas_tracking.integrations.lightning import AtlasCallback
from lightning.pytorch.callbacks import ModelCheckpoint

from atlas_tracking import Canary
from atlas_tracking.cli import main as cli
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.record_checks import assert_receipts_match
from atlas_tracking.testing.tiny import PROSE, QUIET, tiny_canary, tiny_data, tiny_module

warnings.filterwarnings("ignore", ".*does not have many workers.*")
STRICT = {**QUIET, "policy": {"c2_tol": 0.0, "dead_tol": 0.0, "entropy_tol": 0.0, "cv_tol": 0.0, "use_ci": False}}


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _steps(records):
    return [r["step"] for r in records]


def _fit(root, max_steps, callbacks, ckpt_path=None, seed=0, **kw):
    train, val = tiny_data(80, seed=seed)
    trainer = pl.Trainer(max_steps=max_steps, val_check_interval=10, check_val_every_n_epoch=None, logger=False,
                         default_root_dir=str(root), callbacks=callbacks, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1, **kw)
    trainer.fit(tiny_module(), train, val, ckpt_path=ckpt_path)
    return trainer


def _checkpoints(root):
    return ModelCheckpoint(dirpath=root / "ckpt", filename="{step}", every_n_train_steps=10, save_top_k=-1,
                           save_last=True)


def test_resume_from_an_older_checkpoint_leaves_one_history(tmp_path, capsys):
    """A 40-step run resumed from its step-20 checkpoint to step 60: one monotone history, the abandoned
    30 and 40 kept aside with their receipts, the report and replay see the one history."""
    atlas = tmp_path / "atlas"
    _fit(tmp_path, 40, [AtlasCallback(canary=tiny_canary(), config=QUIET), _checkpoints(tmp_path)])
    first = _lines(atlas / "gates.jsonl")
    assert _steps(first) == [0, 10, 20, 30, 40]
    old_30 = (atlas / "receipts" / "step_00000030.json").read_bytes()
    _fit(tmp_path, 60, [AtlasCallback(canary=tiny_canary(), config=QUIET), _checkpoints(tmp_path)],
         ckpt_path=str(tmp_path / "ckpt" / "step=20.ckpt"), seed=1)
    records = _lines(atlas / "gates.jsonl")
    assert _steps(records) == [0, 10, 20, 30, 40, 50, 60]
    assert records[:3] == first[:3]
    assert records[3]["status"] == "BASELINE" and records[3]["resume"] and records[3]["branch"] != first[0]["branch"]
    assert len({r["run_id"] for r in records}) == 1
    abandoned = _lines(atlas / "gates.abandoned.jsonl")
    assert abandoned == first[3:]
    assert_receipts_match(atlas, records)
    assert (atlas / "receipts" / "abandoned" / f"step_00000030.{first[3]['branch']}.json").read_bytes() == old_30
    alerts = _lines(atlas / "alerts.jsonl")
    assert alerts == [a for r in records for a in r["alerts"]]
    assert cli(["replay", str(atlas / "gates.jsonl")]) == 0
    assert [json.loads(x)["step"] for x in capsys.readouterr().out.splitlines()] == [0, 10, 20, 30, 40, 50, 60]
    assert cli(["report", str(tmp_path), "--out", str(tmp_path / "r.html")]) == 0
    from atlas_tracking.artifacts.history import read_history

    assert read_history(tmp_path) == records


def test_fresh_run_never_appends_to_another_runs_record(tmp_path):
    atlas = tmp_path / "atlas"
    _fit(tmp_path, 20, [AtlasCallback(canary=tiny_canary(), config=QUIET)], enable_checkpointing=False)
    first = (atlas / "gates.jsonl").read_text()
    with pytest.warns(UserWarning, match=r"holds the record of another run \(3 gate\(s\), steps 0..20\); this run's "
                                         r"record goes to .*atlas-2"):
        _fit(tmp_path, 20, [AtlasCallback(canary=tiny_canary(), config=QUIET)], enable_checkpointing=False)
    assert (atlas / "gates.jsonl").read_text() == first
    second = _lines(tmp_path / "atlas-2" / "gates.jsonl")
    assert _steps(second) == [0, 10, 20] and second[0]["run_id"] != json.loads(first.splitlines()[0])["run_id"]
    refuse = {**QUIET, "gate": {"existing_record": "refuse"}}
    from atlas_tracking.artifacts.run_dir import RunDirError

    with pytest.raises(RunDirError, match=r"holds the record of another run .* choose another out_dir"):
        _fit(tmp_path, 20, [AtlasCallback(canary=tiny_canary(), config=refuse)], enable_checkpointing=False)
    assert (atlas / "gates.jsonl").read_text() == first and not (tmp_path / "atlas-3").exists()


def test_resume_with_another_canary_is_an_explicit_rebaseline(tmp_path, recwarn):
    atlas = tmp_path / "atlas"
    canary = tiny_canary()
    other = Canary.from_token_ids(PROSE[400_000:], window=32, n_windows=8, seed=1)
    _fit(tmp_path, 20, [AtlasCallback(canary=canary, config=STRICT), _checkpoints(tmp_path)])
    before = _lines(atlas / "gates.jsonl")
    old_base = Path(before[-1]["baseline_path"])  # the restored reference (retention keeps it beside the new one)
    old_bytes = {p.name: p.read_bytes() for p in old_base.iterdir()}
    cb = AtlasCallback(canary=other, config=STRICT)
    _fit(tmp_path, 30, [cb, _checkpoints(tmp_path)], ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert not [w for w in recwarn if "Please add the following callbacks" in str(w.message)]
    records = _lines(atlas / "gates.jsonl")
    assert _steps(records) == [0, 10, 20, 30]
    rebase = records[3]
    assert rebase["status"] == "BASELINE" and rebase["resume"] is True
    assert rebase["canary_changed_from"] == canary.fingerprint and rebase["canary_fingerprint"] == other.fingerprint
    assert rebase["stage_before_resume"] == before[-1]["stage"] != "baseline"
    (alert,) = [a for a in rebase["alerts"] if a["key"] == "canary_change"]
    assert alert["level"] == "INFO"
    assert canary.fingerprint[:16] in alert["text"] and other.fingerprint[:16] in alert["text"]
    assert {p.name: p.read_bytes() for p in old_base.iterdir()} == old_bytes  # moved aside, not overwritten
    assert (atlas / "baseline").resolve() == (atlas / "baselines" / f"step_00000030.{rebase['branch']}").resolve()
    assert cb.gate.state_dict()["canary_fingerprint"] == other.fingerprint


# --- a plain AtlasGate loop ------------------------------------------------------------------------


def _nudge(model, branch: str, step: int) -> None:
    """Stand-in for training: a deterministic weight change per (branch, step), so branches differ."""
    gen = torch.Generator().manual_seed(hash((branch, step)) % (2**31))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))


PLAIN = {"receipts": {"progress": False, "n_bootstrap": 100, "anchors": 32}}


def test_plain_loop_resumes_older_latest_twice_and_back_to_an_abandoned_branch(tmp_path):
    from atlas_tracking.artifacts.history import read_history, read_lines
    from atlas_tracking.gate import AtlasGate

    ids = np.random.default_rng(0).integers(0, 64, 4000)
    canary = Canary.from_token_ids(ids, window=16, n_windows=4, seed=0)
    model = family_model("qwen3_moe")
    weights = {}

    def segment(state_step, state, steps, name):
        gate = AtlasGate(model, canary, PLAIN, out_dir=tmp_path)
        if state is not None:
            model.load_state_dict(weights[state_step])
            gate.resume(state_step, state)
        states = {}
        for s in steps:
            _nudge(model, name, s)
            gate.run(s, loss=1.0 / (s + 1))
            states[s] = json.loads(json.dumps(gate.state_dict()))
            weights[s] = copy.deepcopy(model.state_dict())
        return gate, states

    a, states_a = segment(None, None, [0, 10, 20, 30], "a")
    weights_a = copy.deepcopy(weights)
    b, _ = segment(10, states_a[10], [20, 30, 40], "b")            # from an older state
    history = read_history(tmp_path)
    assert [(r["step"], r["branch"]) for r in history] == [(0, a.branch), (10, a.branch), (20, b.branch),
                                                          (30, b.branch), (40, b.branch)]
    assert [(r["step"], r["branch"]) for r in read_lines(tmp_path / "gates.abandoned.jsonl")] == [
        (20, a.branch), (30, a.branch)]
    assert_receipts_match(tmp_path, history)
    weights.update(weights_a)
    c, _ = segment(30, states_a[30], [40], "c")                     # back to the abandoned branch's state
    history = read_history(tmp_path)
    assert [(r["step"], r["branch"]) for r in history] == [(0, a.branch), (10, a.branch), (20, a.branch),
                                                          (30, a.branch), (40, c.branch)]
    assert sorted((r["step"], r["branch"]) for r in read_lines(tmp_path / "gates.abandoned.jsonl")) == [
        (20, b.branch), (30, b.branch), (40, b.branch)]
    assert_receipts_match(tmp_path, history)
    assert history[-1]["resume"] and history[-1]["stage_before_resume"] == history[-2]["stage"]
    state_c = c.state_dict()
    d, _ = segment(40, state_c, [50], "d")                           # from the latest, twice in a row
    e, _ = segment(50, d.state_dict(), [60], "e")
    history = read_history(tmp_path)
    assert [r["step"] for r in history] == [0, 10, 20, 30, 40, 50, 60]
    assert [r["branch"] for r in history[-3:]] == [c.branch, d.branch, e.branch]
    every = history + read_lines(tmp_path / "gates.abandoned.jsonl")
    assert len({(r["step"], r["branch"]) for r in every}) == len(every) == 10
    assert_receipts_match(tmp_path, history)
    assert e.state_dict()["lineage"] == [[r["step"], r["branch"]] for r in history]


def test_state_and_record_from_before_branches_resume_into_one_history(tmp_path):
    """A checkpoint keyed the old way (by canary) and a record without run ids: found, adopted, resolved."""
    atlas = tmp_path / "atlas"
    _fit(tmp_path, 20, [AtlasCallback(canary=tiny_canary(), config=QUIET), _checkpoints(tmp_path)])
    legacy = [{k: v for k, v in r.items() if k not in ("run_id", "branch")} for r in _lines(atlas / "gates.jsonl")]
    (atlas / "run.json").unlink()
    # the record a resume from step 10 used to leave: the old 20 stays, the new branch appends 20 again
    (atlas / "gates.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*legacy, {**legacy[2], "c2": 0.5}]))
    ckpt = torch.load(tmp_path / "ckpt" / "step=10.ckpt", weights_only=False)
    state = ckpt["callbacks"].pop("AtlasCallback")
    for name in ("run_id", "branch", "lineage"):
        state["gate"].pop(name)
    state["gate"]["baseline_canary"] = state["gate"].pop("canary_fingerprint")
    ckpt["callbacks"][f"AtlasCallback{{'canary': '{tiny_canary().fingerprint[:16]}'}}"] = state
    torch.save(ckpt, tmp_path / "legacy.ckpt")
    cb = AtlasCallback(canary=tiny_canary(), config=QUIET)
    _fit(tmp_path, 30, [cb], ckpt_path=str(tmp_path / "legacy.ckpt"), enable_checkpointing=False)
    records = _lines(atlas / "gates.jsonl")
    assert _steps(records) == [0, 10, 20, 30] and records[2]["resume"] and records[2]["status"] == "BASELINE"
    assert records[:2] == legacy[:2] and cb.resume_counts["moved_aside"] == 2
    assert [r["c2"] for r in _lines(atlas / "gates.abandoned.jsonl")] == [legacy[2]["c2"], 0.5]
