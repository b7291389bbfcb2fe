"""(l) The cost of a gate at frontier layouts, measured at reduced width and fitted (docs/record.md#retention).

Random transformers models with the real routing layouts of Qwen3-30B-A3B (48 routed layers, 128 experts, k 8),
Qwen3-235B-A22B (94 layers, 128 experts, k 8), DeepSeek-V3 (61 layers, the first 3 dense: 58 routed, 256
experts, k 8, one shared expert, group routing 8 / 4, sigmoid scores with a bias) and Kimi K2 (61 layers, the
first dense: 60 routed, 384 experts, k 8, one shared expert, one group), built from the transformers config
classes (``Qwen3MoeConfig``, ``DeepseekV3Config``) with tiny attention and expert sizes, at reduced width
(d = 32-128) and with fewer routed layers (2-8), on a canary of 4-8 windows of 32 tokens. Each point runs a
sequence of gates through ``AtlasGate``: two pretraining gates (the reference rolls), a handoff (a restart
with ``policy.phase: post_training``), a post-training gate and an evaluation, and measures per gate the bytes
written by kind (read with ``atlas_tracking.artifacts.disk_usage``, the module behind ``atlas-tracking du``),
the host peak memory (peak RSS above the start of the gate, the points in one fresh subprocess; device peak on
CUDA), the gate's time against a plain no-grad forward, the baseline's load time and the tracker keys per gate.

Each quantity is fitted by non-negative least squares against layers L, experts E, top-k k, width d, anchors A
and canary tokens T over the points, and the fit is extrapolated to the real layer counts and widths at the
default ``receipts.anchors`` and a 64 x 256-token canary. One point at width 1024 is kept out of the fit and
checked against it. Receipts artifacts are measured in the binary form (``RECEIPTS_FORMAT``), the one the
real layouts write. ``python benchmarks/scale.py`` writes ``benchmarks/scale.json`` and prints the RESULTS.md
tables (``--quick``: fewer points; ``--markdown JSON``: the tables of a written result). Nothing here assumes
the storage format: the fit reads whatever the code writes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atlas_tracking.artifacts.retention import tree_bytes
from atlas_tracking.testing.bench import host_rss, plain_forward, reset_host_peak

HERE = Path(__file__).resolve().parent
WINDOW = 32
"""Tokens per canary window of the measured points (the extrapolation uses 256)."""
N_BOOTSTRAP = 100
"""Bootstrap resamples of the measured gates (the default 1000 adds a fixed cost per gate, not per width)."""


@dataclass(frozen=True)
class Layout:
    """A frontier model's routing layout and real size."""

    family: str
    """transformers model type."""
    layers: int
    """Routed layers of the real model."""
    dense: int
    """Leading dense layers (``first_k_dense_replace``)."""
    experts: int
    k: int
    width: int
    """The real model's hidden size."""
    shared: int = 0
    n_group: int = 1
    topk_group: int = 1


LAYOUTS = {
    "Qwen3-30B-A3B": Layout("qwen3_moe", layers=48, dense=0, experts=128, k=8, width=2048),
    "Qwen3-235B-A22B": Layout("qwen3_moe", layers=94, dense=0, experts=128, k=8, width=4096),
    "DeepSeek-V3": Layout("deepseek_v3", layers=58, dense=3, experts=256, k=8, width=7168, shared=1, n_group=8,
                          topk_group=4),
    "Kimi K2": Layout("deepseek_v3", layers=60, dense=1, experts=384, k=8, width=7168, shared=1),
}


RECEIPTS_FORMAT = "safetensors"
"""The receipts artifacts' form at every point: the one ``gate.receipts_format: auto`` writes at the real layouts
(their per-window arrays hold millions of values, far above ``gate.receipts_binary_above``), so that the fit
extrapolates what a frontier run writes."""


@dataclass(frozen=True)
class Point:
    """One measured model: a layout at reduced size."""

    layout: str
    layers: int = 4
    width: int = 64
    anchors: int = 128
    windows: int = 8
    experts: int | None = None
    """None: the layout's own."""
    k: int | None = None
    budget: int | None = None
    """``receipts.baseline_budget_bytes`` (None: the default), where the configuration has it."""

    def config(self) -> dict[str, Any]:
        """The ``receipts`` settings of the point's gates."""
        out: dict[str, Any] = {"progress": False, "anchors": self.anchors, "n_bootstrap": N_BOOTSTRAP}
        return out if self.budget is None else {**out, "baseline_budget_bytes": self.budget}

    def shape(self) -> dict[str, int]:
        """The fit's variables at this point."""
        lay = LAYOUTS[self.layout]
        return {"L": self.layers, "E": self.experts or lay.experts, "k": self.k or lay.k, "d": self.width,
                "A": min(self.anchors, self.windows * WINDOW), "T": self.windows * WINDOW, "W": self.windows,
                "Tb": min(self.windows, 8) * WINDOW}


def build(point: Point) -> torch.nn.Module:
    """A random model of the point's layout (transformers' own architecture code, tiny attention and experts)."""
    from atlas_tracking.testing.families import family_model

    lay = LAYOUTS[point.layout]
    s = point.shape()
    common = dict(hidden_size=s["d"], intermediate_size=32, moe_intermediate_size=16, num_attention_heads=4,
                  head_dim=8, num_experts_per_tok=s["k"], vocab_size=64)
    if lay.family == "qwen3_moe":
        return family_model("qwen3_moe", num_hidden_layers=s["L"], num_experts=s["E"], norm_topk_prob=True, **common)
    return family_model("deepseek_v3", num_hidden_layers=s["L"] + lay.dense, first_k_dense_replace=lay.dense,
                        n_routed_experts=s["E"], n_shared_experts=lay.shared, n_group=lay.n_group,
                        topk_group=lay.topk_group, **common)


def anchor_estimate(shape: dict[str, int], receipts: dict[str, Any]) -> float:
    """The code's own estimate of a baseline's anchor-tensor bytes at a shape, in the storage form its settings
    choose (``atlas_tracking.engine.anchor_storage``); 0 where the code has no such estimate."""
    try:
        from atlas_tracking.engine.anchor_storage import configured_storage, estimate_bytes
    except ImportError:
        return 0.0
    from atlas_tracking.schema.config import AtlasConfig

    cfg = AtlasConfig.from_dict({"receipts": {k: v for k, v in receipts.items() if k != "progress"}}).receipts
    layout = [(shape["d"], shape["k"], shape["E"])] * shape["L"]
    return float(estimate_bytes(layout, shape["A"], configured_storage(cfg, layout, shape["A"])))


def _kind_bytes(run: Path) -> dict[str, int]:
    from atlas_tracking.artifacts.disk_usage import disk_usage

    usage = disk_usage(run)
    manifests = sum(p.stat().st_size for p in (run / "baselines").glob("*/manifest.json"))
    return {"baseline_tensors": usage["bytes"]["baselines"] - manifests, "baseline_manifest": manifests,
            "receipts": usage["bytes"]["receipts"], "record_line": usage["bytes"]["gates"],
            "evaluations": usage["bytes"]["evaluations"]}


def _written(run: Path, before: dict[str, int], step: int) -> dict[str, int]:
    """Bytes a gate wrote, by kind: the baseline folder of its step, and what the other kinds grew by."""
    after = _kind_bytes(run)
    out = {k: after[k] - before[k] for k in after}
    made = [p for p in (run / "baselines").glob(f"step_{step:08d}.*")]
    manifest = sum(p.joinpath("manifest.json").stat().st_size for p in made)
    out["baseline_tensors"], out["baseline_manifest"] = sum(tree_bytes(p) for p in made) - manifest, manifest
    return out


def run_point(point: Point, device: str = "cpu", out_dir: str | Path | None = None, pretraining: int = 2,
              post_training: int = 1) -> dict[str, Any]:
    """The gate sequence on one point: ``pretraining`` gates, the handoff, ``post_training`` gates, an evaluation
    (steps 0, 10, 20, ...)."""
    from atlas_tracking import Baseline
    from atlas_tracking.artifacts.record import gate_metrics
    from atlas_tracking.gate import AtlasGate
    from atlas_tracking.testing.bench import cpu_seconds
    from atlas_tracking.testing.tiny import random_canary

    s = {**point.shape(), "anchor_estimate": anchor_estimate(point.shape(), point.config())}
    model = build(point).to(device)
    canary = random_canary(n=s["W"], window=WINDOW, vocab=64)
    quiet = {"receipts": point.config(), "gate": {"receipts_format": RECEIPTS_FORMAT}}
    pre_cfg, post_cfg = {**quiet, "policy": {"phase": "pretraining"}}, {**quiet, "policy": {"phase": "post_training"}}
    print(f"(l) {point} ...", file=sys.stderr, flush=True)
    plain_forward(model, canary, 8)                      # kernels and lazy state loaded once
    forward = statistics.median(cpu_seconds({"f": lambda: plain_forward(model, canary, 8)}, 3)["f"])
    run = Path(out_dir or tempfile.mkdtemp()) / "atlas"
    gate = AtlasGate(model, canary, pre_cfg, out_dir=run)
    gates: list[dict[str, Any]] = []

    def one(phase: str, step: int, evaluation: bool = False) -> None:
        before = _kind_bytes(run) if run.exists() else dict.fromkeys(_KINDS, 0)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start_rss, start_dev = reset_host_peak(), torch.cuda.memory_allocated() if device.startswith("cuda") else None
        t0, c0 = time.perf_counter(), time.process_time()
        record = gate.evaluate(step, loss=4.0) if evaluation else gate.run(step, loss=4.0)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        peak = host_rss("VmHWM")
        gates.append({"phase": phase, "step": step, "status": record.get("status"), "seconds": seconds, "cpu_seconds": cpu,
                      "ratio_to_forward": cpu / forward,
                      "host_peak": None if start_rss is None or peak is None else peak - start_rss,
                      "device_peak": (torch.cuda.max_memory_allocated() - start_dev) if start_dev is not None
                      else None,
                      "bytes": _written(run, before, step),
                      "tracker_keys": None if evaluation else len(gate_metrics(record, gate.config.gate.log_per_layer))})

    steps = iter(range(0, 10 * (pretraining + post_training + 2), 10))
    for _ in range(pretraining):
        one("pretraining", next(steps))
    state = gate.state_dict()
    gate.finish()
    gate = AtlasGate(model, canary, post_cfg, out_dir=run)
    handoff = next(steps)
    gate.resume(handoff - 10, state)
    one("handoff", handoff)
    for _ in range(post_training):
        one("post_training", next(steps))
    one("evaluation", next(steps), evaluation=True)
    gate.finish()
    current = run / "baseline"
    load = statistics.median(_timed(lambda: Baseline.load(current)) for _ in range(3))
    folders = sorted(p.name for p in (run / "baselines").iterdir())
    return {"point": asdict(point), "shape": s, "forward_seconds": forward, "baseline_load_seconds": load,
            "baseline_bytes": tree_bytes(current.resolve()), "baseline_folders_kept": len(folders), "baseline_folders": folders,
            "gates": gates}


_KINDS = ("baseline_tensors", "baseline_manifest", "receipts", "record_line", "evaluations")


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --- the fit ------------------------------------------------------------------------------------------------

FEATURES: dict[str, tuple[str, ...]] = {
    "baseline_tensors": ("1", "T", "L*A", "L*A*d", "L*A*k*d", "L*A*E"),
    "baseline_manifest": ("1", "L", "L*E", "L*E*W", "W"),
    "receipts_pretraining": ("1", "L", "L*E", "L*W", "L*E*W"),
    "receipts_post_training": ("1", "L", "L*E", "L*W", "L*E*W"),
    "record_line_pretraining": ("1", "L", "L*E"),
    "record_line_post_training": ("1", "L", "L*E"),
    "evaluation_line": ("1", "L", "L*E"),
    "tracker_keys": ("1", "L", "L*E"),
    "host_peak_pretraining": ("1", "L*A*k*d", "Tb*E", "Tb*d"),
    "host_peak_post_training": ("1", "L*A*k*d", "Tb*E", "Tb*d"),
}
"""Per fitted quantity, its terms (products of L, E, k, d, A, T, W windows, Tb tokens per micro-batch)."""


def term(name: str, shape: dict[str, int]) -> float:
    """The value of a term such as ``L*A*d`` at a shape.

    >>> term("L*A*d", {"L": 2, "A": 3, "d": 4}), term("1", {})
    (24.0, 1.0)
    """
    return float(np.prod([shape[v] for v in name.split("*") if v != "1"]))


def observed(result: dict[str, Any]) -> dict[str, float]:
    """The fitted quantities at one point, from its gate sequence (bytes and keys: a phase's last gate; host
    peak: the largest of the phase)."""
    gates = result["gates"]

    def last(phase: str, fn: Any) -> float:  # the phase's last gate: the steady state (a first gate has less)
        return float([fn(g) for g in gates if g["phase"] == phase][-1])

    def peak(phase: str) -> float:
        return float(max(g["host_peak"] or 0 for g in gates if g["phase"] == phase))

    return {
        "baseline_tensors": last("pretraining", lambda g: g["bytes"]["baseline_tensors"]),
        "baseline_manifest": last("pretraining", lambda g: g["bytes"]["baseline_manifest"]),
        "receipts_pretraining": last("pretraining", lambda g: g["bytes"]["receipts"]),
        "receipts_post_training": last("post_training", lambda g: g["bytes"]["receipts"]),
        "record_line_pretraining": last("pretraining", lambda g: g["bytes"]["record_line"]),
        "record_line_post_training": last("post_training", lambda g: g["bytes"]["record_line"]),
        "evaluation_line": last("evaluation", lambda g: g["bytes"]["evaluations"]),
        "tracker_keys": last("post_training", lambda g: g["tracker_keys"]),
        "host_peak_pretraining": peak("pretraining"),
        "host_peak_post_training": peak("post_training"),
    }


def features(results: list[dict[str, Any]]) -> dict[str, tuple[str, ...]]:
    """The terms of each quantity: a baseline's tensors (and the host peak's anchor part) against the code's own
    estimate of its anchor tensors (a coefficient near 1 says the estimate holds) where the code has one, else
    against the shapes."""
    if all(r["shape"].get("anchor_estimate") for r in results):
        estimate = ("1", "anchor_estimate", "Tb*E", "Tb*d")
        return {**FEATURES, "baseline_tensors": ("1", "T", "anchor_estimate"), "host_peak_pretraining": estimate,
                "host_peak_post_training": estimate}
    return FEATURES


def fit(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Non-negative least squares of each quantity on its terms over the points (no term costs less than
    nothing); the coefficients, R^2 and worst residual."""
    from scipy.optimize import nnls

    out = {}
    for name, terms in features(results).items():
        x = np.array([[term(t, r["shape"]) for t in terms] for r in results])
        y = np.array([observed(r)[name] for r in results])
        coef = nnls(x, y)[0]
        pred = x @ coef
        ss = float(((y - y.mean()) ** 2).sum())
        out[name] = {"terms": list(terms), "coef": [float(c) for c in coef],
                     "r2": 1 - float(((y - pred) ** 2).sum()) / ss if ss else 1.0,
                     "max_rel_residual": float(np.max(np.abs(y - pred) / np.maximum(np.abs(y), 1.0)))}
    return out


def predict(model: dict[str, Any], shape: dict[str, int]) -> float:
    """A fitted quantity at a shape.

    >>> predict({"terms": ["1", "L*E"], "coef": [10.0, 2.0]}, {"L": 3, "E": 4})
    34.0
    """
    return float(sum(c * term(t, shape) for t, c in zip(model["terms"], model["coef"], strict=True)))


def formula(model: dict[str, Any]) -> str:
    """The fitted formula as text.

    >>> formula({"terms": ["1", "L*E"], "coef": [10.0, 2.5]})
    '10 + 2.5·L·E'
    """
    parts = [f"{c:.3g}" if t == "1" else f"{c:.3g}·{t.replace('*', '·')}" for t, c in zip(model["terms"],
                                                                                          model["coef"], strict=True)]
    return " + ".join(parts).replace("+ -", "- ")


def real_shape(lay: Layout, anchors: int, windows: int = 64, window: int = 256, batch_windows: int = 8) -> dict:
    """The fit's variables at a layout's real size, a ``windows`` x ``window`` canary and ``anchors`` anchors (the
    anchor estimate in the storage form the default settings choose)."""
    s = {"L": lay.layers, "E": lay.experts, "k": lay.k, "d": lay.width, "A": min(anchors, windows * window),
         "T": windows * window, "W": windows, "Tb": min(windows, batch_windows) * window}
    return {**s, "anchor_estimate": anchor_estimate(s, {"anchors": anchors})}


def extrapolate(fits: dict[str, Any], kept: int, gates: int = 1000) -> dict[str, dict[str, float]]:
    """Per layout at its real size: bytes per baseline and per gate, bytes under atlas/ for ``gates`` pretraining
    and ``gates`` post-training gates (``kept`` baseline folders stay), host peak and tracker keys per gate."""
    from atlas_tracking.schema.config import AtlasConfig

    anchors = AtlasConfig().receipts.anchors
    out = {}
    for name, lay in LAYOUTS.items():
        s = real_shape(lay, anchors)
        p = {q: predict(m, s) for q, m in fits.items()}
        baseline = p["baseline_tensors"] + p["baseline_manifest"]
        pre = p["receipts_pretraining"] + p["record_line_pretraining"]
        post = p["receipts_post_training"] + p["record_line_post_training"]
        out[name] = {**s, "baseline_bytes": baseline, "pretraining_gate_bytes": baseline + pre,
                     "post_training_gate_bytes": post, "run_bytes": kept * baseline + gates * (pre + post),
                     "host_peak_pretraining": p["host_peak_pretraining"],
                     "host_peak_post_training": p["host_peak_post_training"], "tracker_keys": p["tracker_keys"]}
    return out


POINTS = [
    Point("Qwen3-30B-A3B"), Point("Qwen3-30B-A3B", layers=2), Point("Qwen3-235B-A22B", layers=8, width=32),
    Point("Qwen3-30B-A3B", layers=2, width=128), Point("Qwen3-30B-A3B", k=4), Point("Qwen3-30B-A3B", anchors=64),
    Point("Qwen3-30B-A3B", windows=4), Point("DeepSeek-V3"), Point("Kimi K2", layers=2),
    Point("DeepSeek-V3", budget=700_000),
]
"""The fitted points (a layout's own layer count is replaced by 2-8 routed layers; say so in every table); the
last with a ``receipts.baseline_budget_bytes`` that makes the code choose a compact storage form."""
QUICK = [POINTS[i] for i in (0, 1, 2, 3, 4, 6, 7)]
CHECK = Point("Qwen3-30B-A3B", layers=2, width=1024, windows=4)
"""Kept out of the fit and compared with it: width 1024."""


def size(n: float) -> str:
    """Bytes for a table.

    >>> size(512), size(2.5e6), size(3.2e10)
    ('512 B', '2.5 MB', '32.0 GB')
    """
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


ROWS = {
    "bytes per baseline": (("baseline_tensors", "baseline_manifest"), "baseline_bytes", size),
    "bytes per pretraining gate (baseline, receipts, line)": (
        ("baseline_tensors", "baseline_manifest", "receipts_pretraining", "record_line_pretraining"),
        "pretraining_gate_bytes", size),
    "bytes per post-training gate (receipts, line)": (("receipts_post_training", "record_line_post_training"),
                                                      "post_training_gate_bytes", size),
    "atlas/ after 1,000 pretraining + 1,000 post-training gates": ((), "run_bytes", size),
    "host peak of a pretraining gate": (("host_peak_pretraining",), "host_peak_pretraining", size),
    "host peak of a post-training gate": (("host_peak_post_training",), "host_peak_post_training", size),
    "tracker keys per gate": (("tracker_keys",), "tracker_keys", lambda v: f"{v:.0f}"),
}
"""The extrapolated table: row -> (the fitted quantities it adds up, its key in ``extrapolate``, format)."""
RELIABLE_R2 = 0.95
"""A row is extrapolated only when every fit it adds up explains at least this much of the measured variation."""


def markdown(result: dict[str, Any]) -> str:
    """The RESULTS.md tables of a result: the fits, the extrapolation per layout, the width check, the times."""
    fits, ext, kept = result["fits"], result["extrapolated"], result["baseline_folders_kept"]
    names = list(ext)
    lines = ["| quantity (per gate) | fitted formula | R^2 | worst residual |", "|---|---|---|---|"]
    lines += [f"| {q} | `{m['formula']}` | {m['r2']:.4f} | {100 * m['max_rel_residual']:.1f}% |"
              for q, m in fits.items()]
    lines += ["", "| extrapolated | from | " + " | ".join(
        f"{n} (L={ext[n]['L']}, E={ext[n]['E']}, d={ext[n]['d']})" for n in names) + " |",
              "|---|---|" + "---|" * len(names)]
    for row, (parts, key, fmt) in ROWS.items():
        how = " + ".join(parts) if parts else (f"{kept} x bytes per baseline + 1,000 x (pretraining gate - baseline)"
                                               " + 1,000 x post-training gate")
        r2 = min((fits[q]["r2"] for q in parts), default=1.0)
        cells = ([f"{fmt(ext[n][key])} (extrapolated)" for n in names] if r2 >= RELIABLE_R2
                 else [f"not extrapolated (fit R^2 {r2:.2f})"] * len(names))
        lines.append(f"| {row} | {how} | " + " | ".join(cells) + " |")
    check = result["check_width_1024"]
    lines += ["", f"| width check: {check['point']['point']['layout']} layout, d=1024, "
              f"L={check['point']['shape']['L']}, kept out of the fit | measured | formula | measured / formula |",
              "|---|---|---|---|"]
    for q, v in check["measured"].items():
        p = check["predicted"][q]
        lines.append(f"| {q} | {v:,.0f} | {p:,.0f} | {v / p if p else float('nan'):.3f} |")
    lines += ["", "| measured point | gate / plain forward, pretraining (CPU s) | post-training | baseline load |",
              "|---|---|---|---|"]
    for r in [*result["points"], check["point"]]:
        ratio = result["gate_over_forward"][_label(r)]
        lines.append(f"| {_label(r)} | {ratio['pretraining']:.1f} | {ratio['post_training']:.1f} | "
                     f"{1000 * r['baseline_load_seconds']:.0f} ms |")
    return "\n".join(lines)


def _label(r: dict[str, Any]) -> str:
    s, p = r["shape"], r["point"]
    budget = f" budget={p['budget']}" if p.get("budget") else ""
    return f"{p['layout']} L={s['L']} E={s['E']} k={s['k']} d={s['d']} A={s['A']} T={s['T']}{budget}"


def _in_subprocess(points: list[Point], device: str) -> list[dict[str, Any]]:
    """Run the points one after the other in a fresh process (torch and transformers imported once)."""
    code = (f"import json, runpy; m = runpy.run_path({str(Path(__file__))!r}, run_name='scale_worker'); "
            f"print(json.dumps([m['run_point'](m['Point'](**p), {device!r}) for p in {[asdict(p) for p in points]!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, timeout=3600, check=True,
                          env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from atlas_tracking.testing.bench import write_result

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "scale.json"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer points")
    parser.add_argument("--markdown", metavar="JSON", help="print the RESULTS.md tables of a written result")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    t0 = time.perf_counter()
    points = QUICK if args.quick else POINTS
    print(f"(l) {len(points)} points and the width check ...", file=sys.stderr, flush=True)
    results = _in_subprocess(points, args.device)
    fits = fit(results)
    check = _in_subprocess([CHECK], args.device)[0]
    seen = observed(check)
    kept = max(r["baseline_folders_kept"] for r in results)
    ratios = {_label(r): {
        ph: float(np.median([g["ratio_to_forward"] for g in r["gates"] if g["phase"] == ph]))
        for ph in ("pretraining", "post_training")} for r in [*results, check]}
    result = {
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "points": results, "fits": {k: {**v, "formula": formula(v)} for k, v in fits.items()},
        "check_width_1024": {"point": check, "measured": seen,
                             "predicted": {q: predict(m, check["shape"]) for q, m in fits.items()}},
        "gate_over_forward": ratios, "baseline_folders_kept": kept,
        "extrapolated": extrapolate(fits, kept), "seconds": time.perf_counter() - t0,
    }
    write_result(result, args.out)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
