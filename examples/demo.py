"""The main job: a small MoE trained on real text, where loss improves while the atlas degrades.

``make demo`` runs it on embedded defaults (docs/demo.md says what to look for):

1. healthy: a 32-expert Qwen3-MoE (random init, byte-level) learns English prose that ships with
   Python (``pydoc_data``), every parameter trainable, with a load-balancing loss; gates every
   150 steps from the step-0 baseline. Its first gate has the canary NLL of a uniform guess, so
   the gates are read in the ``pretraining`` phase: each gate against the previous one, no
   escalation, occupancy collapse still alerting, and every gate reporting handoff readiness against
   the healthy reference the operator declares: here the pretraining gate before the handoff, pinned
   (``lifecycle.handoff_reference: gate:N``). It is interrupted at step 600 (the handoff point) and
   resumed from its checkpoint with ``policy.phase: post_training`` at a tenth of the learning rate (a
   gentle continuation on the same prose, the control): the resumed gate is a new BASELINE and the
   post-training base. It is interrupted once more two gates later: that resume is a new baseline too,
   and the gate after it reports its base damage both since that baseline and since the base.
2. stressed: from the step-600 weights, experts, router and FFN norms are frozen and only
   attention and embeddings train, on a shifted regime (Python standard-library source), with a
   fresh optimizer at 10x the pretraining learning rate and no load balancing. Its first gate is
   a trained model's, so it is read in ``post_training``. Loss keeps improving; C2 falls below the
   baseline, dead experts rise, occupancy narrows: the policy revokes the preservation claim at the first
   bad gate and escalates as the later gates say (a persistent degraded plateau stays on ``alert``; two
   further worse gates reach ``intervene``), with alerts and the three predicates.
3. intervention: what the operator does once the claim stays revoked (the paper's Table 14, first row:
   router-prior control at matched scalar success). From the stressed weights at its first gate on
   ``alert`` or beyond, the router and experts are unfrozen and train on the same code with a 5x
   load-balancing loss (the router prior) at the pretraining learning rate. ``atlas-tracking judge``
   then pairs its gates with the stressed run's at matched validation loss and prints the verdict of
   the checks of section 8.9 (real fix / not yet / not comparable), whatever it is.

Each run's last gate also gives the depth profile of routing self-consistency (``ov_cf``) and its
terminal jump (docs/receipts.md#terminal-cliff), printed at the end.

Training is as deterministic as the platform allows (``torch.use_deterministic_algorithms``, a fixed
thread count, seeded data order): one machine gives the same records run after run; another CPU
may differ in the last digits, which the policy's tolerances absorb (docs/policy.md#choosing-tolerances).

The canary is a held-out slice of the prose, fixed for all the runs. Gates go to
``<run>/atlas/gates.jsonl`` first, then to W&B (offline) and MLflow (sqlite), both read back at
the end. ``atlas-tracking report`` turns each run into an HTML page with its pictures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from atlas_tracking import AtlasConfig, Canary
from atlas_tracking.testing.demo import DEMO_CONFIG, data, demo_canary, records
from atlas_tracking.viz.gate_table import gate_table

THREADS = 1
"""One intra-op thread: no float reduction is split differently on a machine with more cores, and a
shared machine does not stall training on thread barriers (two threads ran 5-10x slower under load)."""


@dataclass
class Phase:
    name: str
    steps: int
    lr: float
    aux: float
    freeze_routed: bool
    domain: str
    every: int
    resume_at: int | None = None
    resume_phase: str = "auto"
    """policy.phase of the resumed run ("post_training": the resume is the handoff)."""
    cosine: bool = False
    resume_again: int | None = None
    """A second interruption after the handoff, resumed in the same phase (the base stays the handoff's)."""
    pin: int | None = None
    """The pretraining gate pinned as the declared healthy reference of handoff readiness (``gate:N``)."""
    post_lr_scale: float = 1.0
    """The learning rate after the handoff, as a fraction of the resumed schedule's (post-training refines)."""
    schedule_steps: int | None = None
    """The cosine schedule's length (default ``steps``); past it the learning rate stays at its floor."""


def phases(quick: bool) -> tuple[Phase, Phase, Phase]:
    """The three runs, gated every 150 steps. ``quick`` pretrains for two gates instead of four (the other
    runs keep their gates: the control's resume baseline and two more, five stressed gates, three
    intervention gates)."""
    every = 150
    pretrain = (2 if quick else 4) * every
    return (
        Phase("healthy", pretrain + 4 * every, 3e-3, 0.02, False, "prose", every, resume_at=pretrain,
              resume_phase="post_training", cosine=True, resume_again=pretrain + 2 * every, pin=pretrain - every,
              post_lr_scale=0.1, schedule_steps=pretrain + 3 * every),
        Phase("stressed", 5 * every, 3e-2, 0.0, True, "code", every),
        Phase("intervention", 3 * every, 3e-3, 0.1, False, "code", every, cosine=True),
    )


RUNS = ("healthy", "stressed", "intervention")
"""The demo's runs, each in ``<out>/<run>``."""


ESCALATED = ("alert", "prepare", "intervene")
"""Stages past the first bad gate without a recovery: the claim stays revoked and the operator acts."""


class BranchAtEscalation(pl.Callback):
    """Keeps the weights at the run's first gate whose record (``atlas/gates.jsonl``, the local ground truth)
    reads a stage of :data:`ESCALATED`; listed after the AtlasCallback, whose gate has then been written (after a
    validation, or, for an early gate the training-batch routing alarm asked for, before the next training batch)."""

    def __init__(self, run_dir: Path) -> None:
        self.gates = run_dir / "atlas" / "gates.jsonl"
        self.step: int | None = None
        self.weights: dict[str, torch.Tensor] | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx) -> None:
        self.on_validation_end(trainer, pl_module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.weights is not None or not self.gates.exists():
            return
        last = json.loads(self.gates.read_text().splitlines()[-1])
        if last.get("stage") in ESCALATED:
            self.step = last["step"]
            self.weights = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}


class ScaleLearningRate(pl.Callback):
    """Sets the peak learning rate of a run resumed from a checkpoint (whose optimizer and schedule are restored) to
    ``scale`` x the module's own: the same fraction at every resume, never compounded."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        peak = pl_module.lr * self.scale
        for config in trainer.lr_scheduler_configs:  # the demo's cosine LambdaLR
            sched = config.scheduler
            sched.base_lrs = [peak for _ in sched.base_lrs]
            for group, fn in zip(sched.optimizer.param_groups, sched.lr_lambdas):
                group["lr"] = peak * fn(sched.last_epoch)
        if not trainer.lr_scheduler_configs:
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = peak


def make_loggers(run_dir: Path, name: str, trackers: bool) -> list[Any]:
    if not trackers:
        return []
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ["WANDB_MODE"] = "offline"
    wandb_logger = WandbLogger(project="atlas-demo", name=name, save_dir=str(run_dir), offline=True)
    mlflow_logger = MLFlowLogger(experiment_name="atlas-demo", run_name=name,
                                 tracking_uri=f"sqlite:///{(run_dir.parent / 'mlflow.db').resolve()}",
                                 artifact_location=str((run_dir.parent / "mlartifacts").resolve()))
    return [wandb_logger, mlflow_logger]


def train(phase: Phase, weights: dict | None, streams, canary: Canary, out: Path, trackers: bool, seed: int = 0,
          extra_callbacks: tuple = ()):
    """A Lightning run with the AtlasCallback (interrupted and resumed at ``resume_at`` when set).

    Returns the final module and, for an interrupted run, the weights at the interruption.
    """
    from atlas_tracking.integrations.lightning import AtlasCallback
    from lightning.pytorch.callbacks import ModelCheckpoint

    from atlas_tracking.testing.lightning_lm import MoELM, build_qwen3_moe, loaders

    run_dir = out / phase.name
    shutil.rmtree(run_dir, ignore_errors=True)
    train_s, val_s, _ = streams[phase.domain]
    train_dl, val_dl = loaders(train_s, val_s, window=128, batch=16, steps=phase.steps, seed=seed, val_windows=16)

    def module() -> MoELM:
        m = MoELM(build_qwen3_moe(seed=seed), lr=phase.lr, aux_coef=phase.aux, freeze_routed=phase.freeze_routed,
                  cosine_steps=(phase.schedule_steps or phase.steps) if phase.cosine else 0)
        if weights is not None:
            m.model.load_state_dict(weights)
        return m

    def fit(max_steps: int, ckpt_path: str | None, loggers: list[Any], policy_phase: str = "auto",
            lr_scale: float = 1.0) -> MoELM:
        pl.seed_everything(seed, verbose=False)
        config = {**DEMO_CONFIG, "policy": {**DEMO_CONFIG["policy"], "phase": policy_phase}}
        if phase.pin is not None:  # the operator pins a pretraining gate as the healthy reference of readiness
            config["lifecycle"] = {**DEMO_CONFIG["lifecycle"], "handoff_reference": f"gate:{phase.pin}"}
        ckpt = ModelCheckpoint(dirpath=run_dir / "checkpoints", save_last=True, every_n_train_steps=phase.every)
        trainer = pl.Trainer(
            max_steps=max_steps, val_check_interval=phase.every, check_val_every_n_epoch=None,
            default_root_dir=str(run_dir), logger=loggers or False,
            callbacks=[AtlasCallback(canary, config), ckpt, ScaleLearningRate(lr_scale), *extra_callbacks],
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu",
            devices=1, log_every_n_steps=50,
        )
        m = module()
        trainer.fit(m, train_dl, val_dl, ckpt_path=ckpt_path)
        return m

    loggers = make_loggers(run_dir, phase.name, trackers)  # one W&B run and one MLflow run per phase
    try:
        if phase.resume_at is None:
            return fit(phase.steps, None, loggers), None
        interrupted = fit(phase.resume_at, None, loggers)
        weights = {k: v.detach().clone() for k, v in interrupted.model.state_dict().items()}
        last = str(run_dir / "checkpoints" / "last.ckpt")
        scale = phase.post_lr_scale
        if phase.resume_again is not None:  # a second restart: a resume baseline, the base stays the handoff's
            fit(phase.resume_again, last, loggers, phase.resume_phase, scale)
        return fit(phase.steps, last, loggers, phase.resume_phase, scale), weights
    finally:
        for logger in loggers:
            logger.finalize("success")
        if trackers:
            import wandb

            wandb.finish()


def judge_intervention(out: Path, branch_step: int) -> dict[str, Any]:
    """``atlas-tracking judge`` of the intervention against the stressed run, under the demo's tolerances."""
    from atlas_tracking.decisions.judge import judge, table

    result = judge(out / "stressed" / "atlas", out / "intervention" / "atlas", AtlasConfig.from_dict(DEMO_CONFIG))
    print(f"\n== atlas-tracking judge: the intervention (from the stressed step {branch_step}) against the stressed "
          "run, at matched validation loss")
    print(table(result))
    return {"branch_step": branch_step, "verdict": result["verdict"], "failing": result["failing"],
            "reason": result["reason"], "checks": result["checks"],
            "pairs": [(p["stressed_step"], p["candidate_step"]) for p in result["pairs"]]}


def protected(out: Path) -> dict[str, Any]:
    """``atlas-tracking protect`` on the stressed run: the layers ``protected_layers: auto`` chose, and why."""
    from atlas_tracking.decisions.protection import protect, table

    result = protect(out / "stressed" / "atlas", AtlasConfig.from_dict(DEMO_CONFIG))
    print("\n== atlas-tracking protect: the stressed run's protected layers (section 8.8), from its gates")
    print(table(result))
    return {"ordinals": result["ordinals"], "evidence_steps": result["evidence_steps"],
            "layers": [{k: r[k] for k in ("ordinal", "name", "chosen", "rank", "reason")} for r in result["layers"]]}


def base_damage(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kl_base and the canary NLL delta of each gate against its baseline, and since the post-training base
    (docs/receipts.md#base-domain-damage)."""
    keys = ("kl_base", "kl_base_ci", "canary_nll_delta", "canary_nll_delta_ci", "base_step", "kl_base_cumulative",
            "kl_base_cumulative_ci", "canary_nll_delta_cumulative", "canary_nll_delta_cumulative_ci")
    return [{"step": r["step"], "reference_step": r.get("baseline_step"), **{k: r.get(k) for k in keys}}
            for r in recs if r.get("kl_base") is not None]


def predicates(rec: dict[str, Any]) -> dict[str, Any]:
    """The three predicates of a post-training gate (docs/policy.md#the-three-predicates)."""
    return {"step": rec["step"], **{name: {"verdict": p["verdict"], "reason": p["reason"]}
                                    for name, p in (rec.get("predicates") or {}).items()}}


def cliff(rec: dict[str, Any]) -> dict[str, Any]:
    """The ``ov_cf`` depth profile of a gate and its terminal jump (docs/receipts.md#terminal-cliff)."""
    return {"step": rec["step"], "profile": [layer["ov_cf"] for layer in rec["layers"]],
            "terminal_jump": rec.get("ov_cf_terminal_jump"), "terminal_jump_ci": rec.get("ov_cf_terminal_jump_ci"),
            "cliff_ordinal": rec.get("ov_cf_cliff_ordinal"), "note": rec.get("ov_cf_cliff_note")}


def compare_checkpoints(pretrained: dict, stressed, canary: Canary, out: Path) -> None:
    """Save both ends of the stressed run as transformers checkpoints and run ``atlas-tracking compare``."""
    from atlas_tracking.cli import main as cli
    from atlas_tracking.testing.lightning_lm import build_qwen3_moe

    base = build_qwen3_moe(seed=0)
    base.load_state_dict(pretrained)
    base.save_pretrained(out / "hf" / "pretrained")
    stressed.model.save_pretrained(out / "hf" / "stressed")
    print("\n== atlas-tracking compare: the handoff weights vs the end of the stressed run", flush=True)
    cli(["compare", "--base", str(out / "hf" / "pretrained"), "--candidate", str(out / "hf" / "stressed"),
         "--canary", str(out / "canary.npz"), "--out", str(out / "drift.json"), "--quiet"])


def readiness(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Handoff readiness of the pretraining gates (docs/policy.md#lifecycle-phases)."""
    return [{"step": r["step"], "status": r["status"], "stage": r["stage"], "ready": r["handoff"]["ready"],
             "stable_gates": r["handoff"]["stable_gates"], "margin": r["handoff"]["margin"],
             "reference": r["handoff"].get("reference"), "basis": r["handoff"].get("basis"),
             "reasons": r["handoff"]["reasons"]} for r in recs if r.get("phase") == "pretraining" and r.get("handoff")]


def decoupling(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The stressed run's numbers: loss at phase start and end against C2 and dead experts vs baseline."""
    base, post = recs[0], [r for r in recs[1:] if r.get("loss") is not None]
    first, last = post[0], post[-1]
    return {
        "loss_first_gate": first["loss"], "loss_last_gate": last["loss"],
        "c2_baseline": base["c2"], "c2_last": last["c2"],
        "dead_baseline": base["dead_experts"], "dead_last": last["dead_experts"],
        "min_entropy_baseline": base["min_entropy"], "min_entropy_last": last["min_entropy"],
        "cv_baseline": base["mean_cv"], "cv_last": last["mean_cv"],
        "stages": [r["stage"] for r in recs], "final_stage": last["stage"],
    }


def read_back(out: Path) -> dict[str, Any]:
    """Count what the trackers hold: W&B offline files (wandb's own records) and the MLflow store."""
    found: dict[str, Any] = {}
    try:
        from atlas_tracking.testing.wandb_offline import wait_for_offline_run

        for run in RUNS:
            for run_dir in sorted((out / run / "wandb").glob("offline-run-*")):
                data = wait_for_offline_run(run_dir)
                found.setdefault(f"wandb/{run}", []).append(
                    {"atlas_rows": sum(1 for row in data["history"] if "atlas/status_code" in row),
                     "train_rows": sum(1 for row in data["history"] if "atlas/train/load_cv_max" in row),
                     "alerts": [a["title"] for a in data["alerts"]]})
    except ImportError as exc:
        found["wandb"] = f"not read ({exc})"
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
        exp = client.get_experiment_by_name("atlas-demo")
        for run in client.search_runs([exp.experiment_id]):
            hist = client.get_metric_history(run.info.run_id, "atlas/c2")
            train = client.get_metric_history(run.info.run_id, "atlas/train/load_cv_max")
            found.setdefault(f"mlflow/{run.info.run_name}", []).append(
                {"atlas/c2 points": len(hist), "atlas/train/load_cv_max points": len(train),
                 "atlas.stage": run.data.tags.get("atlas.stage")})
    except Exception as exc:  # reading back is a report, not a requirement of training
        found["mlflow"] = f"not read ({type(exc).__name__}: {exc})"
    return found


def deterministic() -> None:
    """As deterministic as the platform allows: deterministic kernels and a fixed thread split."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(THREADS)


def run(out: Path, quick: bool = False, seed: int = 0, trackers: bool = True, extras: bool = True) -> dict[str, Any]:
    """Both runs of the main job into ``out``; ``extras`` adds the checkpoint comparison and the reports."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("mlflow.db", "mlartifacts"):
        p = out / stale
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    t0, c0 = time.perf_counter(), time.process_time()
    streams = data()
    canary = demo_canary(streams)
    canary.save(out / "canary.npz")
    AtlasConfig.from_dict(DEMO_CONFIG)  # validate the embedded config up front
    healthy, stress, fix = phases(quick)
    print(f"== {healthy.name}: {healthy.resume_at} steps of pretraining on prose from random weights (all parameters), "
          f"interrupted, resumed with policy.phase {healthy.resume_phase} to {healthy.steps} steps (seed {seed})",
          flush=True)
    _, weights = train(healthy, None, streams, canary, out, trackers=trackers, seed=seed)
    print(f"== {stress.name}: {stress.steps} steps on {stress.domain} from the step-{healthy.resume_at} weights, "
          f"experts+router frozen, fresh optimizer at lr {stress.lr:g}", flush=True)
    branch = BranchAtEscalation(out / stress.name)
    stressed_model, _ = train(stress, weights, streams, canary, out, trackers=trackers, seed=seed,
                              extra_callbacks=(branch,))
    if branch.weights is None:  # the policy never escalated: the last stressed weights are the stressed state
        branch.step = records(out / stress.name)[-1]["step"]
        branch.weights = {k: v.detach().clone() for k, v in stressed_model.model.state_dict().items()}
    print(f"== {fix.name}: {fix.steps} steps on {fix.domain} from the stressed step-{branch.step} weights (its first "
          f"gate on alert or beyond), router and experts trainable, load-balancing weight {fix.aux:g}, lr {fix.lr:g}", flush=True)
    train(fix, branch.weights, streams, canary, out, trackers=trackers, seed=seed)
    if extras:
        compare_checkpoints(weights, stressed_model, canary, out)
    phases_run = (healthy, stress, fix)
    results = {phase.name: records(out / phase.name) for phase in phases_run}
    for phase in phases_run:
        print(f"\n-- {phase.name} gates ({out / phase.name / 'atlas' / 'gates.jsonl'})")
        print(gate_table(results[phase.name]))
    summary = {"seed": seed, "quick": quick, "stressed": decoupling(results["stressed"]),
               "pretraining": readiness(results["healthy"]),
               "healthy_stages": [r["stage"] for r in results["healthy"]],
               "healthy_status": [r["status"] for r in results["healthy"]],
               "intervention_stages": [r["stage"] for r in results["intervention"]],
               "protected": protected(out),
               "param_drift": {name: recs[-1].get("param_drift") for name, recs in results.items()},
               "base_damage": {name: base_damage(recs) for name, recs in results.items()},
               "predicates": {name: predicates(recs[-1]) for name, recs in results.items()},
               "judge": judge_intervention(out, branch.step),
               "cliff": {name: cliff(recs[-1]) for name, recs in results.items()},
               "wall_time_s": round(time.perf_counter() - t0, 1), "cpu_time_s": round(time.process_time() - c0, 1)}
    if trackers:
        summary["trackers"] = read_back(out)
    if extras:
        from atlas_tracking.viz.html_report import write_report

        for phase in phases_run:
            write_report(out / phase.name, out / phase.name / "report.html", png_dir=out / phase.name / "figures")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    last = summary["pretraining"][-1]
    print(f"\n== handoff readiness at the end of pretraining (step {last['step']}): "
          f"{'ready' if last['ready'] else 'not ready'}, handoff margin "
          f"{'n/a' if last['margin'] is None else format(last['margin'], '+.4f')} "
          f"(against {last['reference'] or 'no declared reference'}); basis: {last['basis']}")
    for reason in last["reasons"]:
        print(f"   - {reason}")
    d = summary["stressed"]
    print("\n== decoupling in the stressed run")
    print(f"loss {d['loss_first_gate']:.3f} -> {d['loss_last_gate']:.3f} while C2 {d['c2_baseline']:+.4f} -> "
          f"{d['c2_last']:+.4f}, dead experts/layer {d['dead_baseline']:.2f} -> {d['dead_last']:.2f}, "
          f"min entropy {d['min_entropy_baseline']:.2f} -> {d['min_entropy_last']:.2f}, "
          f"mean CV {d['cv_baseline']:.0f} -> {d['cv_last']:.0f}")
    if summary["param_drift"]["stressed"]:  # the contrast surface (paper Table 7): what moved, beside the atlas
        from atlas_tracking.receipts.param_drift import drift_line

        print("stressed " + drift_line(summary["param_drift"]["stressed"]))
    print("stressed stages:", " -> ".join(d["stages"]))
    print("healthy stages: ", " -> ".join(summary["healthy_stages"]))
    print("intervention stages:", " -> ".join(summary["intervention_stages"]))
    print("\n== terminal cliff: ov_cf by routed layer at each run's last gate, and the terminal jump "
          "(terminal layer minus the mean of the band before it)")
    for name, c in summary["cliff"].items():
        print(f"{name:12s} step {c['step']:4d}  ov_cf {' '.join(f'{v:.3f}' for v in c['profile'])}  terminal jump "
              f"{c['terminal_jump']:+.3f} {_ci(c['terminal_jump_ci'])}" + (f"  ({c['note']})" if c["note"] else ""))
    print("\n== base-domain damage: KL(reference || now) on the canary (bounded, top-32 of the reference kept in its "
          "baseline) and the canary NLL change, per gate against its baseline and, in post-training, since the base "
          "(kept across resumes)")
    for name, rows in summary["base_damage"].items():
        print(f"{name:12s} " + "; ".join(
            f"{r['step']}: KL {r['kl_base']:.4f} {_ci(r['kl_base_ci'])} dNLL {_signed(r['canary_nll_delta'])} "
            f"(vs {r['reference_step']})" + (
                f", since the base ({r['base_step']}) KL {r['kl_base_cumulative']:.4f} dNLL "
                f"{_signed(r['canary_nll_delta_cumulative'])}" if r.get("base_step") is not None else "")
            for r in rows))
    print("\n== the three predicates at each run's last gate")
    for name, p in summary["predicates"].items():
        for key in ("protected_rewrite", "base_damage", "knowledge_expansive"):
            if key in p:
                print(f"{name:12s} step {p['step']:4d}  {key:20s} {p[key]['verdict']:12s} {p[key]['reason']}")
    j = summary["judge"]
    print(f"\n== judge verdict on the intervention: {j['verdict']}"
          + (f" (failing: {', '.join(j['failing'])})" if j["failing"] else "")
          + (f" ({j['reason']})" if j["reason"] else ""))
    if trackers:
        print("trackers read back:", json.dumps(summary["trackers"]))
    if extras:
        print(f"reports: {', '.join(str(out / p.name / 'report.html') for p in phases_run)}")
    print(f"wall time {summary['wall_time_s']}s (CPU time of this process {summary['cpu_time_s']}s: one training "
          "thread, so about the wall time of an idle machine)")
    return summary


def _signed(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.3f}"


def _ci(ci: list[float | None] | None) -> str:
    lo, hi = ci or (None, None)
    return f"[{_signed(lo)}, {_signed(hi)}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/demo")
    parser.add_argument("--quick", action="store_true", help="fewer gates (used by the end-to-end test)")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation and data order (the canary is fixed)")
    parser.add_argument("--no-trackers", action="store_true", help="skip W&B and MLflow")
    parser.add_argument("--no-extras", action="store_true", help="skip the checkpoint comparison and the reports")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    deterministic()
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    run(Path(args.out), quick=args.quick, seed=args.seed, trackers=not args.no_trackers, extras=not args.no_extras)
    return 0


if __name__ == "__main__":
    sys.exit(main())
