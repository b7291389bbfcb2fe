"""``make gpu-check``: on a CUDA machine, the tests marked ``gpu``, the Megatron-Core loop and the GPU benchmark,
written to one JSON (``benchmarks/gpu_check.json``).

Sections, each in a process of its own with a time limit, the JSON rewritten after each (a section that fails or
runs out of time is recorded as such, and the next one runs):

- ``tests``: ``pytest -m gpu`` (every supported family on CUDA in fp32 and bf16, Megatron-Core's real MoE layer),
  outcome and recorded properties per test;
- ``megatron``: ``examples/megatron_loop.py`` on the GPU (NCCL, the alltoall dispatcher, real router gating),
  then ``atlas-tracking verify`` on every receipts artifact it wrote;
- ``realistic``: a Qwen3-MoE-shaped model at d = 2048, 768-wide experts, E = 64, 128, 256, k = 8, 8 routed
  layers, bf16, a 64 x 1024-token canary: gate / plain no-grad forward (the default field kernels, and on CUDA the
  eager ones beside them, ``receipts.kernels``), the path each layer took, peak memory ratio, host synchronisations
  per gate and the source lines that make them (``torch.cuda.set_sync_debug_mode``), gate seconds against canary tokens, and the training overhead at
  one gate per 1000 steps of a forward + backward over 8 x 1024 tokens (the optimizer step left out); with
  ``--before DIR``, the gate of an earlier commit's package beside this tree's in the same process (its ratio, and on
  CUDA its peak memory, host synchronisations and training overhead), for before and after on one machine in one
  call;
- ``profile``: ``torch.profiler``'s top operators of one gate at E = 128 (16 x 1024 tokens), device and host time;
- ``scale``: the DeepSeek-V3 layout at its real width (7168; tiny attention and 16-wide experts, so the layer
  stack fits): bytes of a baseline and per gate, gate seconds (``benchmarks/scale.py``'s gate sequence).

Example (a CPU machine runs the smoke sizes, to check the script itself):
    python benchmarks/gpu_check.py --out /tmp/gpu_check.json --smoke

An earlier commit for ``--before``: ``python benchmarks/gpu_check.py --prepare-before dae42a0`` writes its package,
renamed ``atlas_tracking_dae42a0``, under ``build/gpu_before/`` (from this checkout's git history; an ignored folder,
so a device run names it among the paths it carries), then on the GPU machine
``make gpu-check GPU_ARGS="--before build/gpu_before/atlas_tracking_dae42a0"``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

SECTIONS = ("tests", "megatron", "realistic", "profile", "scale")
LIMITS = {"tests": 180, "megatron": 90, "realistic": 150, "profile": 60, "scale": 110}
"""Seconds each section may run (``--budget`` scales them down proportionally when it is smaller)."""


def sibling(name: str) -> SimpleNamespace:
    """``benchmarks/<name>.py`` run as a module of its own (``run``: the benchmark's model, canary and timing;
    ``scale``: the frontier layouts' gate sequence), its globals as attributes."""
    return SimpleNamespace(**runpy.run_path(str(HERE / f"{name}.py"), run_name=f"gpu_check_{name}"))


def environment() -> dict[str, Any]:
    """The machine and the versions a result holds for."""
    import transformers

    out: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                           "python": platform.python_version(), "cuda": torch.version.cuda,
                           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    try:
        from megatron.core import package_info

        out["megatron_core"] = package_info.__version__
    except ImportError:
        out["megatron_core"] = None
    return out


def junit_results(path: Path) -> dict[str, Any]:
    """Per test of a pytest junit XML: its outcome and recorded properties, with the counts."""
    tests: dict[str, Any] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                detail = (node.get("message") or "")[:300]
                break
        entry: dict[str, Any] = {"outcome": outcome}
        if outcome != "passed":
            entry["detail"] = detail
        props = case.find("properties")
        if props is not None:
            entry.update({p.get("name"): float(p.get("value")) for p in props.iter("property")})
        tests[f"{case.get('classname')}::{case.get('name')}"] = entry
    counts = {k: sum(t["outcome"] == k for t in tests.values()) for k in ("passed", "failed", "error", "skipped")}
    return {"counts": counts, "tests": tests}


def section_tests(limit: float, smoke: bool) -> dict[str, Any]:
    """``pytest -m gpu`` in a subprocess, read back from its junit XML."""
    with tempfile.TemporaryDirectory() as d:
        xml = Path(d) / "junit.xml"
        workers = ["-n", "4"] if importlib.util.find_spec("xdist") and not smoke else []  # the families in parallel
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={xml}",
               *workers, "tests/gpu", "tests/integrations/test_megatron.py"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit)
        out = {"returncode": proc.returncode, "seconds": time.perf_counter() - t0,
               "tail": proc.stdout[-1500:] + proc.stderr[-500:]}
        if xml.exists():
            out.update(junit_results(xml))
            devs = [t["fp32_cuda_vs_cpu_max_deviation"] for t in out["tests"].values()
                    if "fp32_cuda_vs_cpu_max_deviation" in t]
            out["fp32_cuda_vs_cpu_max_deviation"] = max(devs) if devs else None
        return out


def section_megatron(limit: float, smoke: bool) -> dict[str, Any]:
    """The Megatron-Core example loop, then ``atlas-tracking verify`` on its receipts artifacts."""
    with tempfile.TemporaryDirectory() as d:
        steps = "20" if smoke else "100"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "examples/megatron_loop.py", "--steps", steps, "--every", "10" if smoke
                               else "25", "--out", d], cwd=ROOT, capture_output=True, text=True, timeout=limit)
        out: dict[str, Any] = {"returncode": proc.returncode, "seconds": time.perf_counter() - t0,
                               "tail": proc.stdout[-800:] + proc.stderr[-800:]}
        records = [json.loads(line) for line in (Path(d) / "gates.jsonl").read_text().splitlines()] \
            if (Path(d) / "gates.jsonl").exists() else []
        out["gates"] = [{k: r.get(k) for k in ("step", "status", "gate_seconds")} for r in records]
        verified = []
        for artifact in sorted((Path(d) / "receipts").glob("step_*")):
            v = subprocess.run([sys.executable, "-m", "atlas_tracking.cli", "verify", str(artifact)], cwd=ROOT,
                               capture_output=True, text=True, timeout=120)
            verified.append({"artifact": artifact.name, "returncode": v.returncode, "said": v.stderr[-300:]})
        out["verify"] = verified
        return out


def _syncs(fn) -> tuple[int, list[tuple[str, int]]]:
    """Host synchronisations ``fn`` makes on the current CUDA device (``torch.cuda.set_sync_debug_mode``), and
    the ten source lines that make the most of them (``file:line``, count)."""
    import collections
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    return len(syncs), where.most_common(10)


def _train_step_seconds(model, tokens: torch.Tensor, repeats: int) -> float:
    """Median seconds of a forward + backward over ``tokens`` (the optimizer step left out)."""
    times = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(input_ids=tokens, labels=tokens, use_cache=False).loss.backward()
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


SMOKE = {"hidden": 256, "moe_intermediate": 64, "experts": (16, 32), "layers": 2, "windows": 8, "window": 128}
"""The realistic model and canary at smoke sizes (``--smoke``)."""


def realistic_spec(bench: SimpleNamespace, smoke: bool) -> dict[str, Any]:
    """``benchmarks/run.py``'s realistic GPU configuration with 1024-token windows, or its smoke sizes."""
    return {**bench.REALISTIC["cuda"], "window": 1024, **(SMOKE if smoke else {})}


def model_shape(spec: dict[str, Any], experts: int) -> dict[str, Any]:
    """The ``realistic_model`` arguments of ``spec`` with ``experts`` experts."""
    return {k: spec[k] for k in ("hidden", "moe_intermediate", "top_k", "layers", "dtype")} | {"experts": experts}


def section_realistic(limit: float, smoke: bool, before: str | None = None) -> dict[str, Any]:
    """Gate against a plain forward at realistic width, one row per expert count; with ``before`` (a renamed
    package's folder, ``--prepare-before``) that package's gate beside this tree's."""
    from atlas_tracking import AtlasConfig, measure
    from atlas_tracking.testing.bench import import_renamed

    bench = sibling("run")

    spec = realistic_spec(bench, smoke)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = AtlasConfig.from_dict(bench.QUIET)
    eager = AtlasConfig.from_dict({"receipts": {**bench.QUIET["receipts"], "kernels": "eager"}})
    window = spec["window"]
    canary = bench.demo_canary(n_windows=spec["windows"], window=window)
    old = None if before is None else import_renamed(Path(before))
    if old is not None:
        old_cfg = old.AtlasConfig.from_dict(bench.QUIET)
        old_canary = old.Canary(windows=canary.windows, offsets=canary.offsets, seed=canary.seed)
    deadline = time.perf_counter() + limit
    rows = []
    for e in spec["experts"]:
        if time.perf_counter() > deadline - 30:
            rows.append({"experts": e, "skipped": "out of time"})
            continue
        model = bench.realistic_model(**model_shape(spec, e), device=device)
        gate = lambda m=model, c=canary: measure(m, c, config=cfg, keep_anchors=False)  # noqa: E731
        passes = {"plain": lambda m=model: bench.plain_forward(m, canary, 8), "gate": gate}
        if device == "cuda":  # the field arithmetic eager beside the default (compiled) path, in the same call
            passes["gate_eager"] = lambda m=model, c=canary: measure(m, c, config=eager, keep_anchors=False)
        if old is not None:
            passes["gate_before"] = lambda m=model: old.measure(m, old_canary, config=old_cfg, keep_anchors=False)
        t = bench.interleaved(passes, 3)
        row: dict[str, Any] = {"experts": e, **t, "ratio": t["gate"] / t["plain"],
                               "kernels": sorted({lay["selfcheck"]["kernels"] for lay in gate().layers})}
        if old is not None:
            row["ratio_before"] = t["gate_before"] / t["plain"]
        if device == "cuda":
            row["ratio_eager"] = t["gate_eager"] / t["plain"]
            row["peak_memory"] = bench.peak_memory(model, canary)
            row["host_syncs_per_gate"], row["host_syncs_where"] = _syncs(gate)
            row["host_syncs_per_plain_forward"], _ = _syncs(lambda m=model: bench.plain_forward(m, canary, 8))
            if old is not None:
                peak = bench.cuda_peak(passes["gate_before"])
                row["peak_memory_before"] = {"gate": peak, "ratio": peak / max(row["peak_memory"]["plain_forward"], 1)}
                row["host_syncs_per_gate_before"], row["host_syncs_where_before"] = _syncs(passes["gate_before"])
        if e == spec["experts"][len(spec["experts"]) // 2]:
            scaling = []
            for n in (8, 16, 32, spec["windows"]) if not smoke else (2, 4, 8):
                c = bench.demo_canary(n_windows=n, window=window)
                tt = bench.interleaved({"plain": lambda m=model, c=c: bench.plain_forward(m, c, 8),
                                        "gate": lambda m=model, c=c: measure(m, c, config=cfg, keep_anchors=False)}, 2)
                scaling.append({"tokens": c.n_tokens, **tt, "ratio": tt["gate"] / tt["plain"]})
            row["canary_tokens_scaling"] = scaling
            if device == "cuda":
                model.train()
                step = _train_step_seconds(model, torch.from_numpy(canary.windows[:8]).to(device), 3)
                model.eval()
                row["training_overhead_one_gate_per_1000_steps"] = {
                    "train_step_seconds": step, "tokens_per_step": 8 * window,
                    "fraction": t["gate"] / (1000 * step),
                    **({"fraction_before": t["gate_before"] / (1000 * step)} if old is not None else {})}
        rows.append(row)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return {**{k: v for k, v in spec.items() if k != "experts"}, "canary_tokens": canary.n_tokens,
            **({"before": Path(before).name} if before else {}), "rows": rows}


def section_profile(limit: float, smoke: bool) -> dict[str, Any]:
    """Where a gate's time goes at realistic width (the middle expert count, E = 128): ``torch.profiler``'s top
    operators of one gate by device time and by host time, against a plain forward's totals."""
    from torch.profiler import ProfilerActivity, profile

    from atlas_tracking import AtlasConfig, measure

    bench = sibling("run")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = realistic_spec(bench, smoke)
    experts = spec["experts"][len(spec["experts"]) // 2]
    model = bench.realistic_model(**model_shape(spec, experts), device=device)
    canary = bench.demo_canary(n_windows=4 if smoke else 16, window=spec["window"])
    cfg = AtlasConfig.from_dict(bench.QUIET)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    out: dict[str, Any] = {"experts": experts, "canary_tokens": canary.n_tokens}
    for name, fn in (("plain", lambda: bench.plain_forward(model, canary, 8)),
                     ("gate", lambda: measure(model, canary, config=cfg, keep_anchors=False))):
        fn()
        with profile(activities=activities) as prof:
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
        events = prof.key_averages()
        key = "device_time_total" if device == "cuda" else "cpu_time_total"
        top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:15]
        out[name] = {"device_ms_total": sum(e.self_device_time_total for e in events) / 1e3 if device == "cuda" else None,
                     "host_ms_total": sum(e.self_cpu_time_total for e in events) / 1e3,
                     "top": [{"op": e.key, "calls": e.count, "device_ms": getattr(e, "self_device_time_total", 0) / 1e3,
                              "host_ms": e.self_cpu_time_total / 1e3} for e in top]}
    return out


def section_scale(limit: float, smoke: bool) -> dict[str, Any]:
    """The DeepSeek-V3 layout at its real width: ``benchmarks/scale.py``'s gate sequence on one point."""
    scale = sibling("scale")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    point = scale.Point("DeepSeek-V3", layers=4, width=256, anchors=64, windows=4) if smoke else \
        scale.Point("DeepSeek-V3", layers=16, width=7168, anchors=1024, windows=32)
    result = scale.run_point(point, device)
    gates = result.pop("gates")
    return {**result, "gates": [{k: g[k] for k in ("phase", "status", "seconds", "device_peak", "bytes")}
                                for g in gates]}


RUNNERS = {"tests": section_tests, "megatron": section_megatron, "realistic": section_realistic,
           "profile": section_profile, "scale": section_scale}


def run_section(name: str, limit: float, smoke: bool, before: str | None = None) -> dict[str, Any]:
    """One section in a fresh process, given ``limit`` seconds (``before``: for the realistic section); its JSON, or
    what stopped it."""
    with tempfile.TemporaryDirectory() as d:
        part = Path(d) / "part.json"
        cmd = [sys.executable, str(Path(__file__)), "--section", name, "--out", str(part), "--limit", str(limit)]
        if before and name == "realistic":
            cmd += ["--before", before]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd + (["--smoke"] if smoke else []), cwd=ROOT, capture_output=True, text=True,
                                  timeout=limit + 60)
        except subprocess.TimeoutExpired:
            return {"error": f"out of time after {limit + 60:.0f} s"}
        if proc.returncode != 0 or not part.exists():
            return {"error": f"exit {proc.returncode}", "tail": proc.stderr[-2000:]}
        return json.loads(part.read_text()) | {"section_seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "gpu_check.json"))
    parser.add_argument("--only", nargs="*", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--budget", type=float, default=sum(LIMITS.values()), help="seconds for all sections")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script itself, on any machine")
    parser.add_argument("--before", help="an earlier commit's renamed package (--prepare-before), timed beside this "
                        "tree's gate in the realistic section")
    parser.add_argument("--prepare-before", metavar="COMMIT", help="write COMMIT's renamed package under --into, then "
                        "stop (needs this checkout's git history)")
    parser.add_argument("--into", default=str(ROOT / "build" / "gpu_before"))
    parser.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prepare_before:
        from atlas_tracking.testing.bench import renamed_package_at

        into = Path(args.into)
        shutil.rmtree(into / f"atlas_tracking_{args.prepare_before}", ignore_errors=True)
        into.mkdir(parents=True, exist_ok=True)
        print(renamed_package_at(args.prepare_before, into, ROOT))
        return 0
    if args.before and not (Path(args.before) / "__init__.py").is_file():
        parser.error(f"--before {args.before}: no package there (make one with --prepare-before COMMIT)")
    if args.section:
        extra = {"before": args.before} if args.section == "realistic" and args.before else {}
        Path(args.out).write_text(json.dumps(RUNNERS[args.section](args.limit, args.smoke, **extra), indent=1))
        return 0
    scale_down = min(1.0, args.budget / sum(LIMITS[s] for s in args.only))
    result: dict[str, Any] = {"environment": environment(), "smoke": args.smoke}
    for name in args.only:
        print(f"gpu-check: {name} ...", file=sys.stderr, flush=True)
        result[name] = run_section(name, LIMITS[name] * scale_down, args.smoke, args.before)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    failed = [n for n in args.only if "error" in result[n] or result[n].get("returncode", 0) != 0]
    print(f"gpu-check: wrote {args.out}; sections with a failure: {failed or 'none'}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
