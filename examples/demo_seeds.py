"""The demo across seeds: gate-to-gate noise of the healthy runs, and the verdicts the demo's tolerances give.

    python examples/demo_seeds.py --seeds 1 2 3 4 5 --out out/seeds [--quick] [--jobs 2]

Each seed (model initialisation and data order; the canary is fixed) runs the demo's two runs in
its own process, without trackers or extras. Read from the records (paired deltas, docs/receipts.md#paired-deltas):

- pretraining: gate-to-gate changes of C2, dead experts, min entropy and mean CV (the reference
  rolls forward), after the first post-baseline gate (the random-init transition is listed apart);
- control: each gate after the resume baseline against that baseline;
- stressed: each gate against its baseline.

The verdicts are re-derived from the records with ``replay`` under the demo's configuration, so a
change of tolerances is judged without retraining. Prints the tables of docs/policy.md's "Choosing
tolerances" guide quotes and writes ``<out>/noise.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from atlas_tracking import AtlasConfig
from atlas_tracking.decisions.replay import replay
from atlas_tracking.testing.demo import DEMO_CONFIG, records
from atlas_tracking.viz.tables import format_table

HERE = Path(__file__).resolve().parent

RECEIPTS = ("c2", "dead_experts", "min_entropy", "mean_cv")
BAD_SIGN = {"c2": -1, "dead_experts": 1, "min_entropy": -1, "mean_cv": 1}
"""The direction in which each receipt degrades."""


def run_seed(seed: int, out: Path, quick: bool) -> float:
    """One seed of the demo in its own process; returns its wall time."""
    cmd = [sys.executable, str(HERE / "demo.py"), "--no-trackers", "--no-extras", "--seed", str(seed),
           "--out", str(out / f"seed_{seed}")] + (["--quick"] if quick else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (out / f"seed_{seed}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"seed {seed} failed:\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t0


def deltas(recs: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Paired change of each policy receipt against the record's own reference (its baseline_step).

    Baseline records are left out by the caller (a resume baseline carries drift against the
    reference before it, which is not the noise of the run that follows).
    """
    return [{"step": r["step"], "reference": r.get("baseline_step"), **{k: r[f"{k}_delta"] for k in RECEIPTS}}
            for r in recs if r.get(f"{RECEIPTS[0]}_delta") is not None]


def split_healthy(recs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Pretraining records, and the control's records from its resume baseline on."""
    resumed = next(i for i, r in enumerate(recs) if r.get("resume"))
    return recs[:resumed], recs[resumed:]


def verdicts(recs: list[dict[str, Any]], config: AtlasConfig) -> list[dict[str, Any]]:
    return [{"step": d["step"], "phase": d["phase"], "status": d["status"], "stage": d["stage"],
             "stage_alerts": [a["level"] for a in d["alerts"] if a["key"].startswith("stage:")],
             "ready": (d.get("handoff") or {}).get("ready")} for d in replay(recs, config)]


def analyse(out: Path, seeds: list[int], config: AtlasConfig) -> dict[str, Any]:
    result: dict[str, Any] = {"config": config.to_dict()["policy"], "seeds": {}}
    for seed in seeds:
        healthy = records(out / f"seed_{seed}" / "healthy")
        stressed = records(out / f"seed_{seed}" / "stressed")
        pre, control = split_healthy(healthy)
        pre_d = deltas(pre)
        result["seeds"][seed] = {
            "pretraining_first": pre_d[:1], "pretraining": pre_d[1:], "control": deltas(control[1:]),
            "stressed": deltas(stressed[1:]),
            "verdicts": {"pretraining": verdicts(pre, config), "control": verdicts(control, config),
                         "stressed": verdicts(stressed, config)},
        }
    for part in ("pretraining", "control"):
        result[f"{part}_max_abs"] = {k: max((abs(d[k]) for s in result["seeds"].values() for d in s[part]), default=None)
                                     for k in RECEIPTS}
    result["control_max_bad"] = {
        k: max(BAD_SIGN[k] * d[k] for s in result["seeds"].values() for d in s["control"]) for k in RECEIPTS}
    result["stressed_min_bad"] = {
        k: min(BAD_SIGN[k] * d[k] for s in result["seeds"].values() for d in s["stressed"]) for k in RECEIPTS}
    return result


def print_tables(result: dict[str, Any]) -> None:
    header = ["seed", "part", "gates", *(f"max |d {k}|" for k in RECEIPTS)]
    rows = []
    for seed, s in result["seeds"].items():
        for part in ("pretraining_first", "pretraining", "control"):
            if s[part]:
                rows.append([seed, part, len(s[part]), *(max(abs(d[k]) for d in s[part]) for k in RECEIPTS)])
        rows.append([seed, "stressed (min bad-way)", len(s["stressed"]),
                     *(min(BAD_SIGN[k] * d[k] for d in s["stressed"]) for k in RECEIPTS)])
    print(format_table(header, rows))
    print("\nhealthy noise over all seeds (max |change|):")
    for part in ("pretraining", "control"):
        print(f"  {part:12s}", "  ".join(f"{k} {v:.4g}" for k, v in result[f"{part}_max_abs"].items()))
    print("  control     ", "  ".join(f"{k} {v:.4g}" for k, v in result["control_max_bad"].items()),
          "(largest change the bad way: what a tolerance must clear)")
    print("  stressed     ", "  ".join(f"{k} {v:.4g}" for k, v in result["stressed_min_bad"].items()),
          "(smallest change the bad way)")
    print("\nverdicts under the demo's tolerances", json.dumps(result["config"]))
    for seed, s in result["seeds"].items():
        v = s["verdicts"]
        pre_bad = [(x["step"], x["status"], x["stage_alerts"]) for x in v["pretraining"]
                   if x["status"] in ("YELLOW", "RED") or set(x["stage_alerts"]) & {"WARN", "ERROR"}]
        ready = [x["step"] for x in v["pretraining"] if x["ready"]]
        print(f"  seed {seed}: pretraining YELLOW/RED or WARN/ERROR: {pre_bad or 'none'}; handoff ready at {ready or 'none'}")
        print(f"          control: {' -> '.join(x['status'] + '/' + x['stage'] for x in v['control'])}")
        print(f"          stressed: {' -> '.join(x['stage'] for x in v['stressed'])}; stage alerts "
              f"{[a for x in v['stressed'] for a in x['stage_alerts']]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--out", default="out/seeds")
    parser.add_argument("--quick", action="store_true", help="the end-to-end test's shortened demo")
    parser.add_argument("--jobs", type=int, default=1, help="seeds run at once (each demo uses one thread)")
    parser.add_argument("--analyse-only", action="store_true", help="re-read existing runs (e.g. after a tolerance change)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.analyse_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            times = list(pool.map(lambda s: run_seed(s, out, args.quick), args.seeds))
        print("wall time per seed (s):", dict(zip(args.seeds, (round(t, 1) for t in times))))
    result = analyse(out, args.seeds, AtlasConfig.from_dict(DEMO_CONFIG))
    print_tables(result)
    (out / "noise.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
