"""A gate's host memory at many routed layers: how far a process's resident memory rises above a warmed-up model's.

``python benchmarks/gate_memory.py`` writes ``benchmarks/gate_memory.json``. A freshly initialised Qwen3-MoE of width 64
with 24 routed layers x 128 experts, k = 8, over a 32 x 128-token canary (default ``receipts.anchors``), on the CPU.
Each case runs in a fresh process (``--case``), ``--repeats`` times: the model is built and runs one plain forward
over the canary, the process's peak is reset to its resident size then (``VmRSS``), and two gates of the case run;
the figure is the peak (``VmHWM``) above that start. Two gates, because memory a gate frees may stay with the
process's allocator: what the process holds after the first is part of its footprint at the second.

- ``gate``: gates that neither make nor read a baseline;
- ``making_baseline``: gates that each make a baseline and save it (pretraining: every gate makes the next
  reference);
- ``reading_baseline``: gates read against a baseline saved beforehand by another process.

Beside them: the baseline's bytes and its largest routed layer's tensors (from the file's header), the scale a
gate's host memory is read against (docs/record.md#baselines-on-disk; results in ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from atlas_tracking import AtlasConfig, Baseline, Canary, measure
from atlas_tracking.artifacts.tensor_file import TensorFile, nbytes, tensor_meta
from atlas_tracking.testing.bench import (
    gate_bench_inputs,
    host_rss,
    plain_forward,
    reset_host_peak,
    write_result,
)

HERE = Path(__file__).resolve().parent
LAYERS, EXPERTS, WIDTH, TOP_K, WINDOWS = 24, 128, 64, 8, 32
CASES = ("gate", "making_baseline", "reading_baseline")


def _model_and_canary() -> tuple[torch.nn.Module, Canary]:
    return gate_bench_inputs(WIDTH, LAYERS, EXPERTS, TOP_K, WINDOWS)


def _layer_bytes(path: Path) -> dict[str, int]:
    """A baseline file's bytes per routed layer index (and ``kl``), from its header."""
    tensors, _ = TensorFile.hashed(path / "anchors.safetensors", OSError)
    out: dict[str, int] = {}
    for name in tensors:
        dtype, shape = tensor_meta(tensors, name)
        part = name.split(".")[0]
        out[part] = out.get(part, 0) + nbytes(dtype, shape)
    return out


def one_case(case: str, reference: Path | None) -> dict[str, Any]:
    """The rise of this process's resident memory over two gates of ``case`` above a warmed-up model's."""
    torch.set_num_threads(1)
    model, canary = _model_and_canary()
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False}})
    folder = Path(tempfile.mkdtemp())  # under the run's TMPDIR, removed with it
    gates = {
        "gate": lambda: measure(model, canary, config=cfg, keep_anchors=False),
        "making_baseline": lambda: Baseline.from_report(measure(model, canary, config=cfg)).save(folder / "made"),
        "reading_baseline": lambda: measure(model, canary, baseline=Baseline.load(reference), config=cfg),
    }
    plain_forward(model, canary, cfg.receipts.batch_windows)
    start = reset_host_peak()
    for _ in range(2):
        gates[case]()
    peak = host_rss("VmHWM")
    return {"host_peak_bytes": None if start is None or peak is None else peak - start}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="fresh processes per case")
    ap.add_argument("--case", choices=CASES, help="measure one case in this process and print it as JSON")
    ap.add_argument("--reference", type=Path, help="with --case: the saved baseline a reading gate reads")
    ap.add_argument("--out", default=str(HERE / "gate_memory.json"))
    args = ap.parse_args(argv)
    if args.case:
        print(json.dumps(one_case(args.case, args.reference)))
        return 0
    with tempfile.TemporaryDirectory() as folder:
        result = measure_cases(Path(folder), args.repeats)
    write_result(result, args.out)
    return 0


def measure_cases(folder: Path, repeats: int) -> dict[str, Any]:
    """Every case in ``repeats`` fresh processes each, their scratch files under ``folder``."""
    model, canary = _model_and_canary()
    reference = Baseline.from_report(measure(model, canary, config={"receipts": {"progress": False}})).save(folder / "b")
    layers = _layer_bytes(reference)
    result: dict[str, Any] = {
        "layers": LAYERS, "experts": EXPERTS, "width": WIDTH, "top_k": TOP_K, "canary": f"{WINDOWS} x 128 tokens",
        "repeats": repeats, "baseline_bytes": sum(layers.values()),
        "largest_layer_bytes": max(v for k, v in layers.items() if k.isdigit()), "cases": {},
    }
    for case in CASES:
        command = [sys.executable, __file__, "--case", case, "--reference", str(reference)]
        runs = [json.loads(subprocess.run(command, check=True, capture_output=True, text=True, timeout=1800,
                                          env={**os.environ, "TMPDIR": str(folder)}).stdout.splitlines()[-1])
                for _ in range(repeats)]
        peaks = [r["host_peak_bytes"] for r in runs]
        result["cases"][case] = {"host_peak_mb": [None if p is None else round(p / 1e6, 1) for p in peaks],
                                 "median_mb": None if None in peaks else round(statistics.median(peaks) / 1e6, 1)}
    return result


if __name__ == "__main__":
    raise SystemExit(main())
