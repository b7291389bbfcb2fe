"""The main job: a small MoE trained on real text, where loss improves while the atlas degrades.

``make demo`` runs it on embedded defaults (about 4 minutes on 2 CPU cores):

1. healthy: a 32-expert Qwen3-MoE (random init, byte-level) learns English prose that ships with
   Python (``pydoc_data``), every parameter trainable, with a load-balancing loss; gates every
   200 steps against the first gate's baseline. It is interrupted after pretraining and resumed
   from its checkpoint for a healthy continuation (the control): the resumed gate is a new
   BASELINE, later gates compare against it, and the run stays GREEN / clean.
2. stressed: from the pretrained weights (the interruption point), experts, router and FFN norms
   are frozen and only attention and embeddings train, on a shifted regime (Python standard-
   library source), with a fresh optimizer at 10x the pretraining learning rate and no load
   balancing. Loss keeps improving; C2 falls below the baseline, dead experts rise, occupancy
   narrows, and the policy walks from revoked to intervene, with alerts.

The canary is a held-out slice of the prose, fixed for all three runs. Gates go to
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from demo_data import code_text, encode, prose_text  # noqa: E402

from atlas_tracking import AtlasConfig, Canary  # noqa: E402
from atlas_tracking.tables import format_table  # noqa: E402

DEMO_CONFIG: dict[str, Any] = {
    "receipts": {"progress": False, "anchors": 512},
    "lifecycle": {"protected_layers": "mid"},
    "policy": {"c2_tol": 0.01, "dead_tol": 3.0, "entropy_tol": 0.15, "cv_tol": 15.0, "n_recover": 2},
    "alerts": {"rules": [{"metric": "dead_experts", "op": ">", "value": 12, "scope": "any_protected_layer",
                          "level": "WARN", "min_interval_steps": 400}]},
}
"""Embedded atlas config of the demo (the same keys a user puts in atlas.yaml)."""


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
    baseline_at_start: bool = True
    cosine: bool = False


def phases(quick: bool) -> tuple[Phase, Phase]:
    scale = 0.5 if quick else 1.0

    def n(x: int) -> int:
        return int(x * scale)

    return (
        Phase("healthy", n(1400), 3e-3, 0.02, False, "prose", n(200), resume_at=n(800), baseline_at_start=False,
              cosine=True),
        Phase("stressed", n(1000), 3e-2, 0.0, True, "code", n(200)),
    )


def _split(stream: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a, b = int(0.8 * len(stream)), int(0.9 * len(stream))
    return stream[:a], stream[a:b], stream[b:]


def data() -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return {"prose": _split(encode(prose_text())), "code": _split(encode(code_text(1_500_000)))}


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


def train(phase: Phase, weights: dict | None, streams, canary: Canary, out: Path, trackers: bool, seed: int = 0):
    """A Lightning run with the AtlasCallback (interrupted and resumed at ``resume_at`` when set).

    Returns the final module and, for an interrupted run, the weights at the interruption.
    """
    import lightning.pytorch as pl
    from atlas_tracking.integrations.lightning import AtlasCallback
    from lightning.pytorch.callbacks import ModelCheckpoint
    from moe_lightning import MoELM, build_qwen3_moe, loaders

    run_dir = out / phase.name
    shutil.rmtree(run_dir, ignore_errors=True)
    config = {**DEMO_CONFIG, "gate": {"baseline_at_start": phase.baseline_at_start}}
    train_s, val_s, _ = streams[phase.domain]
    train_dl, val_dl = loaders(train_s, val_s, window=128, batch=16, steps=phase.steps, seed=seed, val_windows=16)

    def module() -> MoELM:
        m = MoELM(build_qwen3_moe(seed=seed), lr=phase.lr, aux_coef=phase.aux, freeze_routed=phase.freeze_routed,
                  cosine_steps=phase.steps if phase.cosine else 0)
        if weights is not None:
            m.model.load_state_dict(weights)
        return m

    def fit(max_steps: int, ckpt_path: str | None, loggers: list[Any]) -> MoELM:
        pl.seed_everything(seed, verbose=False)
        ckpt = ModelCheckpoint(dirpath=run_dir / "checkpoints", save_last=True, every_n_train_steps=phase.every)
        trainer = pl.Trainer(
            max_steps=max_steps, val_check_interval=phase.every, check_val_every_n_epoch=None,
            default_root_dir=str(run_dir), logger=loggers or False, callbacks=[AtlasCallback(canary, config), ckpt],
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
        return fit(phase.steps, str(run_dir / "checkpoints" / "last.ckpt"), loggers), weights
    finally:
        for logger in loggers:
            logger.finalize("success")
        if trackers:
            import wandb

            wandb.finish()


def compare_checkpoints(pretrained: dict, stressed, canary: Canary, out: Path) -> None:
    """Save both ends of the stressed run as transformers checkpoints and run ``atlas-tracking compare``."""
    from moe_lightning import build_qwen3_moe

    from atlas_tracking.cli import main as cli

    base = build_qwen3_moe(seed=0)
    base.load_state_dict(pretrained)
    base.save_pretrained(out / "hf" / "pretrained")
    stressed.model.save_pretrained(out / "hf" / "stressed")
    print("\n== atlas-tracking compare: pretrained (step-800 weights) vs the end of the stressed run", flush=True)
    cli(["compare", "--base", str(out / "hf" / "pretrained"), "--candidate", str(out / "hf" / "stressed"),
         "--canary", str(out / "canary.npz"), "--out", str(out / "drift.json"), "--quiet"])


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "atlas" / "gates.jsonl").read_text().splitlines()]


def gate_table(recs: list[dict[str, Any]]) -> str:
    header = ["step", "loss", "c2", "dc2", "dead", "minH", "cv", "margin", "nll", "status", "stage", "alerts"]
    rows = [[r["step"], r.get("loss"), r.get("c2"), r.get("c2_delta"), r.get("dead_experts"), r.get("min_entropy"),
             r.get("mean_cv"), r.get("margin"), r.get("canary_nll"), r.get("status"), r.get("stage"),
             ",".join(a["level"] for a in r.get("alerts", [])) or "-"] for r in recs]
    return format_table(header, rows)


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
        from atlas_tracking.integrations.wandb import wait_for_offline_run

        for run in ("healthy", "stressed"):
            for run_dir in sorted((out / run / "wandb").glob("offline-run-*")):
                data = wait_for_offline_run(run_dir)
                found.setdefault(f"wandb/{run}", []).append(
                    {"atlas_rows": sum(1 for row in data["history"] if any(k.startswith("atlas/") for k in row)),
                     "alerts": [a["title"] for a in data["alerts"]]})
    except ImportError as exc:
        found["wandb"] = f"not read ({exc})"
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
        exp = client.get_experiment_by_name("atlas-demo")
        for run in client.search_runs([exp.experiment_id]):
            hist = client.get_metric_history(run.info.run_id, "atlas/c2")
            found.setdefault(f"mlflow/{run.info.run_name}", []).append(
                {"atlas/c2 points": len(hist), "atlas.stage": run.data.tags.get("atlas.stage")})
    except Exception as exc:  # reading back is a report, not a requirement of training
        found["mlflow"] = f"not read ({type(exc).__name__}: {exc})"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/demo")
    parser.add_argument("--quick", action="store_true", help="half the steps (used by the end-to-end test)")
    parser.add_argument("--no-trackers", action="store_true", help="skip W&B and MLflow")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("mlflow.db", "mlartifacts"):
        p = out / stale
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    t0 = time.perf_counter()
    streams = data()
    canary = Canary.from_token_ids(streams["prose"][2], window=128, n_windows=64, seed=0)
    canary.save(out / "canary.npz")
    AtlasConfig.from_dict(DEMO_CONFIG)  # validate the embedded config up front
    healthy, stress = phases(args.quick)
    trackers = not args.no_trackers
    print(f"== {healthy.name}: {healthy.resume_at} steps of pretraining on prose (all parameters), interrupted, "
          f"resumed to {healthy.steps} steps", flush=True)
    _, weights = train(healthy, None, streams, canary, out, trackers=trackers)
    print(f"== {stress.name}: {stress.steps} steps on {stress.domain} from the step-{healthy.resume_at} weights, "
          f"experts+router frozen, fresh optimizer at lr {stress.lr:g}", flush=True)
    stressed_model, _ = train(stress, weights, streams, canary, out, trackers=trackers)
    compare_checkpoints(weights, stressed_model, canary, out)
    results: dict[str, Any] = {}
    for phase in (healthy, stress):
        recs = records(out / phase.name)
        print(f"\n-- {phase.name} gates ({out / phase.name / 'atlas' / 'gates.jsonl'})")
        print(gate_table(recs))
        results[phase.name] = recs
    summary = {"stressed": decoupling(results["stressed"]),
               "healthy_stages": [r["stage"] for r in results["healthy"]],
               "healthy_status": [r["status"] for r in results["healthy"]],
               "wall_time_s": round(time.perf_counter() - t0, 1)}
    if trackers:
        summary["trackers"] = read_back(out)
    from atlas_tracking.report import write_report

    for phase in (healthy, stress):
        write_report(out / phase.name, out / phase.name / "report.html", png_dir=out / phase.name / "figures")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    d = summary["stressed"]
    print("\n== decoupling in the stressed run")
    print(f"loss {d['loss_first_gate']:.3f} -> {d['loss_last_gate']:.3f} while C2 {d['c2_baseline']:+.4f} -> "
          f"{d['c2_last']:+.4f}, dead experts/layer {d['dead_baseline']:.2f} -> {d['dead_last']:.2f}, "
          f"min entropy {d['min_entropy_baseline']:.2f} -> {d['min_entropy_last']:.2f}, "
          f"mean CV {d['cv_baseline']:.0f} -> {d['cv_last']:.0f}")
    print("stressed stages:", " -> ".join(d["stages"]))
    print("healthy stages: ", " -> ".join(summary["healthy_stages"]))
    if trackers:
        print("trackers read back:", json.dumps(summary["trackers"]))
    print(f"reports: {', '.join(str(out / p.name / 'report.html') for p in (healthy, stress))}")
    print(f"wall time {summary['wall_time_s']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
