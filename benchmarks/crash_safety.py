"""Crash safety, measured: SIGKILL a Lightning training process with the AtlasCallback at random moments,
resume each time from the latest checkpoint, and check the record and the trackers.

``python benchmarks/crash_safety.py --kills 30`` writes ``benchmarks/crash_safety.json`` and prints the counts;
``--seeds 7 11 13`` runs one soak per seed (``--jobs 2``: two at a time).

Each training process (this file with ``child``) trains the tests' tiny Qwen3-MoE with a gate every 10
steps, W&B offline and MLflow on sqlite, and a checkpoint (``last.ckpt``) at every validation end. It
is killed with SIGKILL at one of four kinds of moment:

- ``random``: a uniformly random time after the process has started (start-up, training, a gate, a
  checkpoint, tracker delivery: wherever it falls);
- ``in_gate``: inside a gate, after the canary was measured and before anything of it was written;
- ``record_write``: while the gate's line is being appended to ``gates.jsonl``: half of the line is
  on disk (a write that a crash cut short) when the kill lands;
- ``delivery``: after a tracker (W&B or MLflow, chosen at random) accepted a gate and before the
  record noted it as delivered.

The three targeted moments are reached through wrappers installed in the child only (named
stand-ins for a slow disk and a slow tracker: they pause at the chosen call so the kill lands there);
the kill itself is a real SIGKILL of the process (its process group, W&B's service included, follows).
A first process trains to its first checkpoints unharmed (a restart without a checkpoint is a fresh
run, recorded in a new directory). After the last kill a final process trains to the end. Then: every record file holds only complete
JSON lines; the history is monotone; every gate the record had acknowledged before a kill (a complete
line of ``gates.jsonl``) is in the history or in ``gates.abandoned.jsonl``, none twice; every history gate's
``receipts/step_N.json`` holds the sha256 its record names (the steps that do not are listed); the last W&B run and the last MLflow run hold exactly the history's gates.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
KINDS = ("random", "in_gate", "record_write", "delivery")
GATE_EVERY = 10


# --- the training process --------------------------------------------------------------------------


def _arm(root: Path, kind: str, count: int) -> None:
    """Pause at the ``count``-th occurrence of the chosen moment, after saying so in ``root/armed.hit``."""
    seen = {"n": 0}

    def hit() -> bool:
        seen["n"] += 1
        if seen["n"] != count:
            return False
        (root / "armed.hit").write_text(kind)
        time.sleep(600)
        return True

    if kind == "in_gate":
        import atlas_tracking.gate as gate_module

        measure = gate_module.measure

        def measured_then_pause(*args, **kwargs):
            report = measure(*args, **kwargs)
            hit()
            return report

        gate_module.measure = measured_then_pause
    elif kind == "record_write":
        import atlas_tracking.sinks.jsonl as sinks_module
        from atlas_tracking.artifacts.history import append_line

        def half_written(path, obj):
            path = Path(path)
            if path.name == "gates.jsonl" and seen["n"] + 1 == count:
                data = (json.dumps(obj, allow_nan=False, separators=(",", ":")) + "\n").encode()
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
                os.write(fd, data[: len(data) // 2])
                os.fsync(fd)
                os.close(fd)
                hit()
            elif path.name == "gates.jsonl":
                seen["n"] += 1
            append_line(path, obj)

        sinks_module.append_line = half_written
    elif kind == "delivery":
        from atlas_tracking.integrations.mlflow import MlflowSink
        from atlas_tracking.integrations.wandb import WandbSink

        cls = random.Random(count).choice([WandbSink, MlflowSink])
        original = cls.log_gate

        def delivered_then_pause(self, record, metrics, step):
            original(self, record, metrics, step)
            hit()

        cls.log_gate = delivered_then_pause


def child(root: Path, max_steps: int, arm: str | None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(root))
    if arm:
        kind, count = arm.split(":")
        _arm(root, kind, int(count))
    import atlas_tracking.gate as gate_module

    resume = gate_module.AtlasGate.resume

    def resume_and_say(self, step, state):
        counts = resume(self, step, state)
        print("RESUME " + json.dumps({"step": step, **counts}), flush=True)
        return counts

    gate_module.AtlasGate.resume = resume_and_say
    import lightning.pytorch as pl
    import wandb
    from atlas_tracking.integrations.lightning import AtlasCallback
    from atlas_tracking.integrations.mlflow import MlflowSink
    from atlas_tracking.integrations.wandb import WandbSink
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

    from atlas_tracking.testing.tiny import QUIET, tiny_canary, tiny_data, tiny_module

    wandb_logger = WandbLogger(project="atlas-crash", save_dir=str(root), offline=True)
    mlflow_logger = MLFlowLogger(experiment_name="atlas-crash", tracking_uri=f"sqlite:///{root / 'mlflow.db'}",
                                 artifact_location=str(root / "mlartifacts"))
    with open(root / "children.jsonl", "a") as fh:  # who this process is, for the read-back
        fh.write(json.dumps({"pid": os.getpid(), "wandb": str(Path(wandb_logger.experiment.dir).parent),
                             "mlflow": mlflow_logger.run_id}) + "\n")
    sinks = [WandbSink(logger=wandb_logger, per_layer_table=False, heatmap=False),
             MlflowSink(logger=mlflow_logger, figures=False)]
    callback = AtlasCallback(canary=tiny_canary(), config=QUIET, sinks=sinks)
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, save_on_train_epoch_end=False)
    train, val = tiny_data(2000)
    trainer = pl.Trainer(max_steps=max_steps, val_check_interval=GATE_EVERY, check_val_every_n_epoch=None,
                         logger=False, default_root_dir=str(root), callbacks=[callback, ckpt],
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         accelerator="cpu", devices=1)
    last = root / "ckpt" / "last.ckpt"
    trainer.fit(tiny_module(), train, val, ckpt_path=str(last) if last.exists() else None)
    wandb.finish()
    return 0


# --- the harness -----------------------------------------------------------------------------------


def _spawn(root: Path, max_steps: int, arm: str | None, log) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), "child", "--root", str(root), "--max-steps", str(max_steps)]
    if arm:
        cmd += ["--arm", arm]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the training process, then whatever it started (W&B's service) in its process group."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _complete_lines(path: Path) -> list[dict[str, Any]]:
    from atlas_tracking.artifacts.history import read_lines

    return read_lines(path)


def _children(root: Path) -> list[dict[str, Any]]:
    path = root / "children.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def run(root: Path, kills: int, seed: int = 0, kinds: tuple[str, ...] = KINDS, max_steps: int = 4000,
        final_extra: int = 30) -> dict[str, Any]:
    """Kill ``kills`` training processes (kinds in turn, shuffled), finish with one more, check; returns the counts."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    plan = [kinds[i % len(kinds)] for i in range(kills)]
    rng.shuffle(plan)
    with open(root / "children.log", "ab") as log:
        return _run(root, plan, rng, max_steps, final_extra, log)


def _run(root: Path, plan: list[str], rng: random.Random, max_steps: int, final_extra: int, log) -> dict[str, Any]:
    atlas = root / "atlas"
    acknowledged: set[tuple[int, str | None]] = set()
    torn_seen = 0
    done = dict.fromkeys(KINDS, 0)
    finished_early = 0
    t0 = time.perf_counter()
    # a first process trains to its first checkpoints: a restart with no checkpoint is a fresh run, whose
    # record goes to a new directory (gate.existing_record), not a resume
    warmup = _spawn(root, 2 * GATE_EVERY, None, log)
    if warmup.wait(timeout=1800) != 0:
        raise RuntimeError("the first training process failed; see children.log")
    for kind in plan:
        (root / "armed.hit").unlink(missing_ok=True)
        started = len(_children(root))
        known = len(_complete_lines(atlas / "gates.jsonl"))
        # a delivery kill lands in the trackers' catch-up (the first `known` deliveries) or at a new gate
        arm = None if kind == "random" else f"{kind}:{rng.randint(1, known + 3 if kind == 'delivery' else 3)}"
        proc = _spawn(root, max_steps, arm, log)
        deadline = time.monotonic() + 600
        if kind == "random":
            while len(_children(root)) == started and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 12.0))
        else:
            while not (root / "armed.hit").exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        if proc.poll() is not None:
            finished_early += 1
        _kill(proc)
        done[kind] += 1
        gates = atlas / "gates.jsonl"
        if gates.exists():
            data = gates.read_bytes()
            torn_seen += int(bool(data) and not data.endswith(b"\n"))
            acknowledged |= {(r["step"], r.get("branch")) for r in _complete_lines(gates)}
    last_step = max((s for s, _ in acknowledged), default=0)
    final = _spawn(root, last_step + final_extra, None, log)
    final_rc = final.wait(timeout=1800)
    log.flush()
    lines = (root / "children.log").read_bytes().splitlines()
    resumes = [json.loads(line.split(b"RESUME ", 1)[1]) for line in lines if line.startswith(b"RESUME ")]
    totals = {f"resume_{k}": sum(r[k] for r in resumes) for k in ("moved_aside", "caught_up", "redelivered")}
    return {"kills": done, "finished_before_the_kill": finished_early, "final_exit_code": final_rc,
            "torn_gate_lines_seen_after_kills": torn_seen, "acknowledged": len(acknowledged),
            "torn_lines_cut": sum(b"cut short by a crash" in line for line in lines),
            "completed_resumes": len(resumes), **totals, "wall_seconds": round(time.perf_counter() - t0, 1),
            **check(root, acknowledged)}


def run_seeds(root: Path, kills: int, seeds: list[int], jobs: int = 1, **kwargs: Any) -> dict[str, Any]:
    """One soak per seed (``root/seed_N``), ``jobs`` of them side by side (each in its own directory, with its own
    children: they share nothing but the machine, so each seed's ``wall_seconds`` then reads the shared machine's);
    the per-seed counts and the totals of what must stay zero."""
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {seed: pool.submit(run, root / f"seed_{seed}", kills, seed, **kwargs) for seed in seeds}
        per_seed = {seed: future.result() for seed, future in futures.items()}
    zero = ("acknowledged_lost", "duplicated_in_record", "receipts_not_matching_their_record",
            "record_files_partial_or_corrupt_lines", "duplicate_steps_within_a_tracker_run")
    return {"seeds": per_seed, "totals": {k: sum(r[k] for r in per_seed.values()) for k in zero},
            "every_seed_matches_its_trackers": all(r["last_wandb_run_equals_history"]
                                                   and r["last_mlflow_run_equals_history"] for r in per_seed.values())}


def check(root: Path, acknowledged: set[tuple[int, str | None]]) -> dict[str, Any]:
    """The counts the issue asks for, read from the run directory and the trackers."""
    from mlflow.tracking import MlflowClient

    from atlas_tracking.artifacts.history import read_history, read_lines
    from atlas_tracking.artifacts.run_dir import RECORD_FILES
    from atlas_tracking.testing.wandb_offline import read_wandb_offline

    atlas = root / "atlas"
    partial = 0
    for name in RECORD_FILES:
        path = atlas / name
        if not path.exists():
            continue
        data = path.read_text()
        partial += int(bool(data) and not data.endswith("\n"))
        for line in data.splitlines():
            try:
                json.loads(line)
            except json.JSONDecodeError:
                partial += 1
    leftovers = [str(p.relative_to(atlas)) for p in atlas.rglob(".*") if p.name.endswith(".tmp") or
                 (p.parent.name == "baselines")]
    history = read_history(atlas)
    raw = read_lines(atlas / "gates.jsonl")
    abandoned = read_lines(atlas / "gates.abandoned.jsonl")
    keys = [(r["step"], r.get("branch")) for r in history + abandoned]
    steps = [r["step"] for r in history]
    receipts_mismatch: list[int] = []  # history gates whose receipts/step_N.json is missing or not the one recorded
    for rec in history:
        path = atlas / "receipts" / f"step_{rec['step']:08d}.json"
        ok = path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == rec.get("receipts_sha256")
        if not ok:
            receipts_mismatch.append(rec["step"])
    gates = [(r.get("log_step", r["step"]), r["gate_seconds"]) for r in history]
    children = _children(root)
    last = children[-1]
    wandb_rows = [(row["trainer/global_step"], row["atlas/gate_seconds"])
                  for row in read_wandb_offline(last["wandb"])["history"] if "atlas/gate_seconds" in row]
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    mlflow_rows = sorted((m.step, m.value) for m in client.get_metric_history(last["mlflow"], "atlas/gate_seconds"))
    tracker_dupes = 0
    for child in children:
        try:
            rows = [row["trainer/global_step"] for row in read_wandb_offline(child["wandb"])["history"]
                    if "atlas/gate_seconds" in row]
        except (FileNotFoundError, ValueError):
            rows = []
        tracker_dupes += len(rows) - len(set(rows))
        ml = [m.step for m in client.get_metric_history(child["mlflow"], "atlas/gate_seconds")]
        tracker_dupes += len(ml) - len(set(ml))
    return {
        "record_files_partial_or_corrupt_lines": partial,
        "temporary_leftovers": leftovers,
        "history_gates": len(history),
        "history_monotone": steps == sorted(set(steps)) and raw == history,
        "abandoned_gates": len(abandoned),
        "acknowledged_lost": len(acknowledged - set(keys)),
        "duplicated_in_record": len(keys) - len(set(keys)),
        "receipts_not_matching_their_record": len(receipts_mismatch),
        "steps_whose_receipts_do_not_match": receipts_mismatch,
        "processes": len(children),
        "last_wandb_run_equals_history": wandb_rows == gates,
        "last_mlflow_run_equals_history": mlflow_rows == sorted(gates),
        "wandb_last_run_missing": len(set(gates) - set(wandb_rows)),
        "mlflow_last_run_missing": len(set(gates) - set(mlflow_rows)),
        "duplicate_steps_within_a_tracker_run": tracker_dupes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    c = sub.add_parser("child")
    c.add_argument("--root", required=True)
    c.add_argument("--max-steps", type=int, required=True)
    c.add_argument("--arm")
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, nargs="+", help="several soaks, one per seed (each --kills kills, in its "
                                                             "own directory); overrides --seed")
    parser.add_argument("--jobs", type=int, default=1, help="soaks of --seeds run side by side (default 1: one "
                                                            "after another, each seed's wall_seconds its own)")
    parser.add_argument("--root", default=None, help="work directory (default: a new temporary one)")
    parser.add_argument("--out", default=str(HERE / "crash_safety.json"))
    args = parser.parse_args(argv)
    if args.command == "child":
        return child(Path(args.root), args.max_steps, args.arm)
    import tempfile

    from atlas_tracking.testing.bench import write_result

    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="atlas-crash-"))
    if args.seeds:
        result = {"root": str(root), **run_seeds(root, args.kills, args.seeds, jobs=args.jobs)}
    else:
        result = {"root": str(root), "seed": args.seed, **run(root, args.kills, args.seed)}
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
