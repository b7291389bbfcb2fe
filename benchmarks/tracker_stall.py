"""Delivery off the training path, measured: a fit against a tracker that accepts connections and never answers.

``python benchmarks/tracker_stall.py`` writes ``benchmarks/tracker_stall.json`` and prints it. The fit is the
tests' tiny Qwen3-MoE (``atlas_tracking.testing.tiny``: d=32, 2 routed layers, E=8, prose windows of 32
tokens, batch 8) with ``AtlasCallback`` and ten gates (the step-0 baseline and one after each of nine
validations), once with an MLflow sink whose tracking URI is a real TCP server on 127.0.0.1 that accepts and never replies
(:class:`atlas_tracking.testing.silent_server.SilentServer`; MLflow's client keeps its default timeout and
retries), once with no tracker; MLflow is imported before either pass. The passes are interleaved, ``--repeats`` each, timed in wall seconds (the
stall is waiting, not computing); the ratio is of the fastest pass of each.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def fit(steps: int, every: int, sinks_of: Callable[[], list[Any]]) -> dict[str, Any]:
    """One fit of ``steps`` steps with a gate every ``every`` steps (``sinks_of()`` gives the extra sinks): the
    gates run, the seconds inside them and the gates each sink still lacked when the fit returned."""
    import lightning.pytorch as pl
    from atlas_tracking.integrations.lightning import AtlasCallback

    from atlas_tracking.testing.tiny import QUIET, tiny_canary, tiny_data, tiny_module

    train, val = tiny_data(steps)
    pl.seed_everything(0, verbose=False)
    callback = AtlasCallback(tiny_canary(), QUIET, sinks=sinks_of())
    with tempfile.TemporaryDirectory() as d:
        trainer = pl.Trainer(max_steps=steps, val_check_interval=every, check_val_every_n_epoch=None, logger=False,
                             default_root_dir=d, callbacks=[callback], enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1,
                             enable_checkpointing=False)
        trainer.fit(tiny_module(), train, val)
        backlog = {name: len(gates) for name, gates in callback.gate.delivery.backlog().items()}
    return {"gates": callback.gate.gates_run, "gate_seconds": callback.gate.seconds_total,
            "backlog_at_the_end": backlog}


def main(argv: list[str] | None = None) -> int:
    from atlas_tracking.integrations.mlflow import MlflowSink

    from atlas_tracking.schema.config import AtlasConfig
    from atlas_tracking.testing.bench import seconds, write_result
    from atlas_tracking.testing.silent_server import SilentServer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--every", type=int, default=50, help="training steps between gates (nine validations)")
    ap.add_argument("--out", default=str(HERE / "tracker_stall.json"))
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    steps = 9 * args.every
    import mlflow.entities  # noqa: F401  (imported before the passes: the cost measured is the stall, not the import)
    runs: dict[str, list[dict]] = {"no_tracker": [], "tracker_never_answers": []}
    with SilentServer() as server:
        sinks = {"no_tracker": list,
                 "tracker_never_answers": lambda: [MlflowSink(tracking_uri=server.uri, run_id="never-answers",
                                                              figures=False)]}
        wall = seconds({name: lambda name=name: runs[name].append(fit(steps, args.every, sinks[name]))
                        for name in sinks}, args.repeats)
        accepted = server.accepted
    best = {name: min(times) for name, times in wall.items()}
    result = {
        "fit": f"tiny Qwen3-MoE (d=32, 2 routed layers, E=8), {steps} steps, a gate every {args.every} steps "
               "(10 gates incl. the step-0 baseline), AtlasCallback in both passes",
        "tracker": "MLflow sink, tracking URI a TCP server on 127.0.0.1 that accepts and never answers "
                   "(MLflow client defaults)",
        "delivery_wait_s": AtlasConfig().gate.delivery_wait_s,
        "connections_accepted_by_the_silent_server": accepted,
        "wall_s_best": best,
        "ratio_never_answers_over_no_tracker": best["tracker_never_answers"] / best["no_tracker"],
        "wall_s": wall,
        "runs": runs,
        "repeats": args.repeats,
    }
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
