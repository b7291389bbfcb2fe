"""The main job, shortened: what the demo is for, on three seeds, not one machine's exact stage path.

Pretraining from random weights reads ``pretraining`` (no YELLOW/RED, no WARN/ERROR stage alert,
handoff readiness on every gate, against the pinned healthy reference once it exists); the control
continuation stays GREEN / clean after each of its two resume baselines, and its last gate reports the
base damage since the handoff's base beside the damage since its baseline; the stressed run improves its
loss while C2, dead experts, entropy and CV degrade, revokes with a WARN and never reads clean again, and
escalates only as Table 13 says; the intervention branches from the stressed run's first gate on alert or
beyond and the judge's verdict (whatever it is) is printed and agrees with the command line's. Seed 0 runs
with the trackers and the report; two more seeds run bare, all three side by side (one torch thread each).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}


def _lowest_priority() -> None:
    """Run in a demo's process before it starts (it leads a session of its own): the lowest CPU priority for it and,
    where the kernel schedules each session as a group (autogroup), for that group, so that the suite's own processes,
    timed ones and servers in sessions of their own included, come first. Without autogroup the process's own nice is
    the one that applies and there is no group to set."""
    os.nice(19)
    if os.path.exists("/proc/self/autogroup"):
        with open("/proc/self/autogroup", "w") as group:
            group.write("19")


def _start(out: Path, *args: str) -> subprocess.Popen:
    """The quick demo started in the background at the lowest CPU priority (:func:`_lowest_priority`: it takes the
    cores the rest of the suite leaves idle), leading a process group of its own; its output goes to ``stdout.txt``
    and ``stderr.txt`` under ``out`` (files, not pipes: a process that is not waited on yet never blocks on a full
    pipe)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "stdout.txt", "w") as stdout, open(out / "stderr.txt", "w") as stderr:
        return subprocess.Popen([sys.executable, str(ROOT / "examples" / "demo.py"), "--quick", "--out", str(out),
                                 *args], env=ENV, stdout=stdout, stderr=stderr, text=True, start_new_session=True,
                                preexec_fn=_lowest_priority)


def _finish(proc: subprocess.Popen, out: Path) -> Path:
    try:
        proc.wait(timeout=2400)  # three demos share the cores: seed 0 alone took 10 minutes
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, (out / "stderr.txt").read_text()[-3000:]
    return out


def _records(out: Path, run: str) -> list[dict]:
    return [json.loads(x) for x in (out / run / "atlas" / "gates.jsonl").read_text().splitlines()]


OTHER_SEEDS = (6, 7)


def start_in_background(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[subprocess.Popen, Path]]:
    """The demo at seed 0 with the trackers and the report, and bare at every other seed, each on one torch thread and
    leading a process group of its own.
    ``tests/conftest.py`` starts them with the session's first test and runs this module's tests last, so the runs
    use the cores the rest of the suite leaves idle instead of the suite waiting for them."""
    outs = {0: tmp_path_factory.mktemp("demo")} | {seed: tmp_path_factory.mktemp(f"demo_seed{seed}")
                                                    for seed in OTHER_SEEDS}
    return {seed: (_start(out, *(("--seed", str(seed), "--no-trackers", "--no-extras") if seed else ())), out)
            for seed, out in outs.items()}


@pytest.fixture(scope="module")
def demos(background_runs) -> dict[int, tuple[subprocess.Popen, Path]]:
    return background_runs[Path(__file__)]


@pytest.fixture(scope="module")
def demo_out(demos) -> Path:
    return _finish(*demos[0])


def stage_alerts(recs: list[dict]) -> list[str]:
    return [a["level"] for r in recs for a in r["alerts"] if a["key"].startswith("stage:")]


def check_pretraining(out: Path) -> None:
    recs = _records(out, "healthy")
    pre = recs[: next(i for i, r in enumerate(recs) if r.get("resume"))]
    assert pre[0]["step"] == 0 and pre[0]["status"] == "BASELINE"
    assert pre[0]["phase_source"].startswith("detected at the first gate") and "freshly initialised" in pre[0][
        "phase_source"]
    assert len(pre) >= 3 and all(r["phase"] == "pretraining" for r in pre)
    assert [r["status"] for r in pre[1:]] == ["GREEN"] * (len(pre) - 1)
    assert not set(stage_alerts(pre)) & {"WARN", "ERROR"}
    assert all(r["stage"] in ("forming", "stable", "ready") for r in pre[1:])
    for prev, r in pairwise(pre):  # the reference rolls forward: each gate against the one before
        assert r["baseline_step"] == prev["step"] and r["handoff"]["reference_step"] == prev["step"]
        assert isinstance(r["handoff"]["ready"], bool) and isinstance(r["handoff"]["margin"], float)
        assert r["handoff"]["ready"] == (r["handoff"]["reasons"] == [])
    assert pre[-1]["loss"] < pre[1]["loss"]
    # the pinned gate (the one before the handoff) is the declared healthy reference from the gate after it on
    pinned = pre[-2]["step"]
    assert all(r.get("handoff_reference") is None for r in pre[:-1])
    assert pre[-1]["handoff_reference"].endswith(f"receipts/step_{pinned:08d}.json")
    assert pre[-1]["handoff"]["basis"].startswith("handoff margin >= 0 against the declared reference")
    assert pre[-2]["handoff"]["basis"] == "stability only (no healthy reference declared)"


def check_control(out: Path) -> None:
    recs = _records(out, "healthy")
    resumed = [i for i, r in enumerate(recs) if r.get("resume")]
    assert len(resumed) == 2
    base, second = recs[resumed[0]], recs[resumed[1]]
    assert (base["status"], base["phase"], base["phase_before_resume"]) == ("BASELINE", "post_training", "pretraining")
    assert (second["status"], second["phase"], second.get("phase_before_resume")) == (
        "BASELINE", "post_training", None)
    after = [r for r in recs[resumed[0]:] if r["status"] != "BASELINE"]
    assert [recs.index(r) for r in after] == [resumed[0] + 1, resumed[1] + 1]
    assert all((r["status"], r["stage"]) == ("GREEN", "clean") for r in after)
    assert all(r["phase"] == "post_training" for r in after)
    assert stage_alerts(after) == []
    # the base is the handoff's across the second resume: the damage since the base accumulates beside the damage
    # since the baseline (plain arithmetic on the records for the canary NLL)
    last = recs[-1]
    assert (last["baseline_step"], last["base_step"]) == (second["step"], base["step"])
    assert last["canary_nll_delta_cumulative"] == pytest.approx(last["canary_nll"] - base["canary_nll"], abs=1e-9)
    assert last["canary_nll_delta"] == pytest.approx(last["canary_nll"] - second["canary_nll"], abs=1e-9)
    assert last["kl_base_cumulative"] > last["kl_base"] > 0
    assert last["refine_reference"] == f"the post-training base (step {base['step']})"
    assert set(last["predicates"]) == {"protected_rewrite", "base_damage", "knowledge_expansive"}
    # the control continues on the prose it learnt: its canary NLL improves since the base, so no base damage
    assert last["predicates"]["base_damage"]["verdict"] != "fail"
    # the handoff chooses the protected set once, from the pretraining gates; the continuation holds it
    pre_steps = [r["step"] for r in recs[1 : resumed[0]]]
    assert base["protected_source"] == (
        f"auto (chosen at step {base['step']} from the pretraining gates {pre_steps}, at the handoff)")
    assert all(r["protected_layers"] == base["protected_layers"] and "protected_change" not in r for r in after)


def check_stressed(out: Path) -> None:
    recs = _records(out, "stressed")
    base, post = recs[0], recs[1:]
    assert base["status"] == "BASELINE" and base["step"] == 0 and base["phase"] == "post_training"
    assert "a trained model" in base["phase_source"]
    validated = [r for r in post if r["loss"] is not None]  # an early gate reads no validation loss
    assert validated[-1]["loss"] < validated[0]["loss"]
    assert post[-1]["c2"] < base["c2"] and post[-1]["dead_experts"] > base["dead_experts"]
    assert post[-1]["min_entropy"] < base["min_entropy"] and post[-1]["mean_cv"] > base["mean_cv"]
    # revoked at the first bad gate, never clean again; escalation only as Table 13 says: two worse gates with
    # the same occupancy pathology before intervene, a persistent plateau stays on alert
    assert post[0]["stage"] == "revoked" and post[0]["rule"].startswith("Table 13 row 1")
    assert all(r["stage"] in ("revoked", "alert", "prepare", "intervene") for r in post)
    assert all(r["status"] in ("YELLOW", "RED") for r in post)
    for prev, r in pairwise(post):
        if r["stage"] == "prepare" and prev["stage"] != "prepare":
            assert r["rule"].startswith("Table 13 row 3")
        if r["stage"] == "intervene" and prev["stage"] != "intervene":
            assert prev["stage"] == "prepare" and r["rule"].startswith("Table 13 row 3: two subsequent worse gates")
    levels = stage_alerts(post)
    assert levels[0] == "WARN" and ("ERROR" in levels) == ("intervene" in [r["stage"] for r in post])
    # the three predicates: frozen experts and router leave the protected atlas unrewritten (the damage is in how
    # it is queried), while the base domain is damaged since the base
    assert all(r["predicates"]["protected_rewrite"]["verdict"] == "pass" for r in post)
    assert post[-1]["predicates"]["base_damage"]["verdict"] == "fail"
    # parameter drift, the contrast surface: experts and router were frozen, so not one of their elements moved
    drift = post[-1]["param_drift"]["groups"]
    assert drift["experts"]["moved"] == 0 and drift["router"]["moved"] == 0
    assert drift["attention"]["moved"] > 0 and drift["embeddings"]["moved"] > 0
    # protected_layers auto: mid until two post-baseline gates exist (an early gate the training-batch routing alarm
    # asked for is one), then chosen once from them and held. The mid band of the demo's four routed layers is layers
    # 1 and 2 and the set holds half the band, so one of them (the rule protects half the band, where it used to
    # protect the whole band of four layers)
    assert [r["protected_source"].startswith("mid (no evidence yet") for r in recs] == [True] * 3 + [False] * (
        len(recs) - 3)
    chosen = recs[3]
    evidence = [r["step"] for r in recs[1:3]]
    assert chosen["protected_source"] == f"auto (chosen at step {chosen['step']} from gates {evidence})"
    assert len(chosen["protected_layers"]) == 1 and set(chosen["protected_layers"]) <= {1, 2}
    assert all((r["protected_layers"], r["protected_source"]) == (chosen["protected_layers"], chosen["protected_source"])
               for r in recs[3:])


def _load(out: Path, run: str) -> list[dict]:
    return [json.loads(x) for x in (out / run / "atlas" / "load.jsonl").read_text().splitlines()]


def check_telemetry(out: Path) -> None:
    """Every training step's routes are in load.jsonl (16 windows of 128 tokens a step, two routes a token, every
    layer); the healthy run (its pretraining and its control continuation) raises no training-batch alarm and no
    early gate; every early gate answers an alarm of the interval ending at its step."""
    for run in ("healthy", "stressed", "intervention"):
        lines, recs = _load(out, run), _records(out, run)
        for line in lines:
            steps = line["step"] - line["first_step"] + 1
            assert all((row["tokens"], sum(row["load"]), row["calls"]) == (2048 * steps, 4096 * steps, steps)
                       for row in line["layers"]), (run, line["step"])
        alarms = {line["step"] for line in lines if any(a["key"] == "telemetry:alarm" for a in line["alerts"])}
        early = {r["step"] for r in recs if r["trigger"] == "telemetry"}
        assert early <= alarms, (run, early, alarms)
        assert all(r["trigger_reason"].startswith("Training-batch routing stayed in breach") for r in recs
                   if r["step"] in early)
        if run == "healthy":
            assert alarms == set() and early == set() and all(line["breach"] == [] for line in lines)


def check_intervention(out: Path) -> None:
    from atlas_tracking.decisions.judge import EXIT_CODES

    stressed, recs = _records(out, "stressed"), _records(out, "intervention")
    summary = json.loads((out / "summary.json").read_text())
    branch = summary["judge"]["branch_step"]
    assert branch == next(r["step"] for r in stressed if r["stage"] in ("alert", "prepare", "intervene"))
    at_branch = next(r for r in stressed if r["step"] == branch)
    assert recs[0]["status"] == "BASELINE" and recs[0]["step"] == 0
    assert len([r for r in recs if r["trigger"] != "telemetry"]) == 4  # early gates come on top of the scheduled ones
    # the intervention's baseline measures the branch weights: the stressed gate's receipts, within float noise
    # (the same weights in a fresh module, the same canary and kernels)
    for key in ("c2", "dead_experts", "min_entropy", "mean_cv", "canary_nll"):
        assert recs[0][key] == pytest.approx(at_branch[key], abs=1e-6)
    text = (out / "stdout.txt").read_text()
    verdict = summary["judge"]["verdict"]
    assert f"== judge verdict on the intervention: {verdict}" in text
    # the command line, as an operator runs it, gives the same verdict and exit code
    proc = subprocess.run([sys.executable, "-m", "atlas_tracking.cli", "judge", "--stressed", str(out / "stressed"),
                           "--candidate", str(out / "intervention" / "atlas" / "gates.jsonl"), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_CODES[verdict] and json.loads(proc.stdout)["verdict"] == verdict
    for run in ("healthy", "stressed", "intervention"):  # the terminal cliff of each run's last gate
        last = _records(out, run)[-1]
        line = next(x for x in text.splitlines() if x.startswith(f"{run:12s} step"))
        assert f"terminal jump {last['ov_cf_terminal_jump']:+.3f}" in line
        assert " ".join(f"{layer['ov_cf']:.3f}" for layer in last["layers"]) in line


@pytest.mark.slow
def test_pretraining_from_random_weights_reads_forming_with_handoff_readiness(demo_out):
    check_pretraining(demo_out)
    text = (demo_out / "stdout.txt").read_text()
    assert "== handoff readiness at the end of pretraining" in text


@pytest.mark.slow
def test_stressed_run_decouples_loss_from_the_atlas(demo_out):
    check_stressed(demo_out)
    assert "decoupling in the stressed run" in (demo_out / "stdout.txt").read_text()


@pytest.mark.slow
def test_control_continuation_stays_clean_after_its_resume_baseline(demo_out):
    check_control(demo_out)


@pytest.mark.slow
def test_training_batch_routing_between_gates(demo_out):
    check_telemetry(demo_out)


@pytest.mark.slow
def test_bounded_kl_to_the_base_is_within_ten_percent_below_the_exact_one_on_the_demo_model(demo_out):
    """``compare`` of the handoff weights and the end of the stressed run: kl_base (K = 32 of 256) against
    the exact full-vocabulary KL; every gate after a baseline carries kl_base and the canary NLL delta.

    Measured: 0.7004 bounded, 0.7404 exact (5.4% below) in this shortened demo (300 pretraining steps: a
    flatter base leaves more mass outside its top 32); 0.8190 and 0.8410 (2.6%) in the full ``make demo``."""
    kl = json.loads((demo_out / "drift.json").read_text())["kl_base"]
    bounded, exact = kl["bounded"]["value"], kl["exact"]["value"]
    assert 0 < bounded <= exact + 1e-6 and exact - bounded <= 0.10 * exact
    for run in ("healthy", "stressed"):
        for r in _records(demo_out, run):
            if r["status"] != "BASELINE":
                assert r["kl_base"] >= 0 and isinstance(r["canary_nll_delta"], float), (run, r["step"])


@pytest.mark.slow
@pytest.mark.parametrize("seed", OTHER_SEEDS)
def test_other_seeds_read_the_same(seed, demos):
    out = _finish(*demos[seed])
    check_pretraining(out)
    check_control(out)
    check_stressed(out)
    check_intervention(out)
    check_telemetry(out)


@pytest.mark.slow
def test_intervention_branches_at_the_first_escalated_gate_and_is_judged(demo_out):
    check_intervention(demo_out)


@pytest.mark.slow
def test_trackers_hold_the_gates(demo_out):
    summary = json.loads((demo_out / "summary.json").read_text())["trackers"]
    stressed = _records(demo_out, "stressed")
    assert summary["mlflow/stressed"][0]["atlas.stage"] == stressed[-1]["stage"]
    assert summary["wandb/stressed"][0]["atlas_rows"] == len(stressed)
    assert summary["wandb/stressed"][0]["train_rows"] == len(_load(demo_out, "stressed"))
    assert summary["mlflow/stressed"][0]["atlas/train/load_cv_max points"] == len(_load(demo_out, "stressed"))
    assert any("entered revoked" in t for t in summary["wandb/stressed"][0]["alerts"])
    assert any("base-domain damage" in t for t in summary["wandb/stressed"][0]["alerts"])


def _chromium() -> str:
    found = shutil.which("chromium")
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True, timeout=900)
    found = shutil.which("chromium")
    if not found:
        pytest.skip("Debian's chromium is not installed and could not be installed here")
    return found


@pytest.mark.slow
def test_report_renders_in_headless_chromium(demo_out, tmp_path):
    from PIL import Image

    report = demo_out / "stressed" / "report.html"
    html = report.read_text()
    assert "http://" not in html and "https://" not in html  # self-contained
    shot = tmp_path / "shot.png"
    proc = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0", "--hide-scrollbars",
         "--window-size=1100,2400", f"--screenshot={shot}", report.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert shot.exists(), proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert console == []
    img = Image.open(shot).convert("L")
    assert img.size == (1100, 2400)
    pixels = img.getdata()
    non_blank = sum(1 for p in pixels if p < 240)
    assert non_blank > 0.02 * len(pixels)
    for png in ("loss_c2.png", "occupancy.png", "expert_load.png", "layer_c2.png", "layer_c2_delta.png",
                "c2_heatmap.png", "stage_timeline.png"):
        assert (demo_out / "stressed" / "figures" / png).stat().st_size > 5000


def test_stressed_report_answers_where_and_what_within_the_top_900_px(demo_out, tmp_path):
    """Playwright with the system Chromium: the verdict, the worst-layer table with its layers x experts picture
    beside it, and the first intervention with its configuration lines all lie within the top 900 px."""
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the dev extra)")
    from atlas_tracking.testing.browser import CHROMIUM, first_screen

    if not CHROMIUM.exists():
        pytest.skip(f"no system chromium at {CHROMIUM}")
    last = _records(demo_out, "stressed")[-1]
    assert last["intervention"]  # the stressed run ends with one
    boxes = first_screen(demo_out / "stressed" / "report.html", tmp_path / "top.png")
    for part, box in boxes.items():
        assert box is not None and box["bottom"] <= 900, (part, box)
    assert boxes["load picture"]["left"] >= boxes["worst layers"]["right"]
