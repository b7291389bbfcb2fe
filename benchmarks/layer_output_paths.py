"""The cost of each way a gate's routed layers give their output (docs/receipts.md#precision).

A gate's forward is the model's own. In fused mode (``receipts.fuse_experts: true``) a layer evaluates its active
set once and hands back the combine of those fields where it equals the experts' own forward bit for bit
(``slots`` or ``ascending``); where no combine does, the experts' own forward runs as well (``own``). With
``fuse_experts: false`` the forward is untouched and the fields are evaluated again in the block's hook
(``unfused``). ``python benchmarks/layer_output_paths.py`` writes ``benchmarks/layer_output_paths.json``: CPU
seconds of a plain no-grad forward over the canary and of a gate on each path, their ratios, and the path every
layer took, at the demo shape (Qwen3-MoE d=64, 4 routed layers, E=32, k=2, 64 x 128-token canary) and at width
1024 (d=1024, 2 routed layers, E=16, k=4, 16 x 128-token canary), each in float32 and bfloat16. The ``own``
path is forced by offering no combine (what a family whose combine is not reproduced pays). One process, one
torch thread, passes interleaved, the medians of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atlas_tracking import AtlasConfig, Canary, measure
from atlas_tracking.engine import combine
from atlas_tracking.testing.bench import cpu_seconds, write_result
from atlas_tracking.testing.demo import demo_canary
from atlas_tracking.testing.lightning_lm import build_qwen3_moe

HERE = Path(__file__).resolve().parent
SHAPES = {
    "demo (d=64, 4 layers, E=32, k=2)": dict(hidden=64, layers=4, experts=32, top_k=2, n_windows=64),
    "width 1024 (d=1024, 2 layers, E=16, k=4)": dict(hidden=1024, layers=2, experts=16, top_k=4, n_windows=16),
}


def plain_forward(model: torch.nn.Module, canary: Canary, batch: int) -> None:
    """The model's own no-grad forward over the canary, in the gate's micro-batches."""
    with torch.no_grad():
        for start in range(0, canary.n_windows, batch):
            model(input_ids=torch.as_tensor(canary.windows[start : start + batch], dtype=torch.long), use_cache=False)


def _gate(model: torch.nn.Module, canary: Canary, fuse: bool, offer: dict[str, Any]) -> Any:
    saved = dict(combine.COMBINES)
    combine.COMBINES.clear()
    combine.COMBINES.update(offer)
    try:
        cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "fuse_experts": fuse, "batch_windows": 8}})
        return measure(model, canary, config=cfg, keep_anchors=False)
    finally:
        combine.COMBINES.clear()
        combine.COMBINES.update(saved)


def one_shape(shape: dict[str, int], dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    model = build_qwen3_moe(seed=0, hidden=shape["hidden"], layers=shape["layers"], experts=shape["experts"],
                            top_k=shape["top_k"], aux_coef=0.0).eval().to(dtype)
    canary = demo_canary()
    canary = Canary.from_token_ids(canary.windows.reshape(-1), window=128, n_windows=shape["n_windows"], seed=0)
    combines = dict(combine.COMBINES)
    passes = {
        "plain": lambda: plain_forward(model, canary, 8),
        "fused": lambda: _gate(model, canary, True, combines),
        "own": lambda: _gate(model, canary, True, {}),
        "unfused": lambda: _gate(model, canary, False, combines),
    }
    paths = {name: sorted({lay["selfcheck"]["layer_output"] for lay in passes[name]().layers})
             for name in ("fused", "own", "unfused")}
    times = cpu_seconds(passes, repeats)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "cpu_seconds_median": med,
        "over_plain_forward": {name: med[name] / med["plain"] for name in ("fused", "own", "unfused")},
        "layer_output": paths,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "layer_output_paths.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    np.random.seed(0)
    result: dict[str, Any] = {"torch_threads": 1, "repeats": args.repeats, "shapes": {}}
    for name, shape in SHAPES.items():
        result["shapes"][name] = [one_shape(shape, dtype, args.repeats) for dtype in (torch.float32, torch.bfloat16)]
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
