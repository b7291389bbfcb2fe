"""What the competitors' expert products cost on a CPU against their share of the rows, in one process.

``python benchmarks/competitor_products.py --width 256`` writes ``benchmarks/competitor_products_w256.json``. For a
freshly initialised Qwen3-MoE (24 routed layers x 128 experts, k = 8, float32, ``--width`` wide) over a 32 x 128-token
canary in micro-batches of 8 windows, it reads each routed layer's routing in a plain forward (the router's own top-k
index, and the adjacent competitor ``e_k1`` of each token, State1's best unselected expert) and then times, with the
experts' own weights, the matrix products a gate runs for them on a CPU (``adapters/grouped_experts.py``), in both of
its ways: one ``torch.mm`` per expert and projection (``expert_by_expert``, the gate's way at widths of 128 and more
here) and two grouped products per layer and micro-batch, transformers' ``_grouped_linear`` (``grouped``, its way at
width 64), the activation between them replaced by a copy of the same size. Each way for the active rows (the model's
own: the forward runs them too) and for the adjacent competitors' rows, one row per token. And the competitors' rows
pooled over each layer's micro-batches (``competitors_pooled``: one product per expert and layer, as if a gate held
them until the layer's last micro-batch). Random rows of the right shapes: a product's time depends on its shape only.
One torch thread, user seconds, the passes interleaved, the median of ``--repeats``; ``rows_share`` is the
competitors' rows over the active rows (1 / k), ``time_share`` the competitors' (and the pooled ones') products' time
over the active products', per way. Also each projection's microseconds per row of one product of ``M`` rows, for
``M`` from 1 to 128, and how the competitors' rows fall into products of each size. The gate's random competitors (a
tenth of the tokens) and the self-check's sample (16 tokens a layer) are left out. Results in
``benchmarks/RESULTS.md`` (w).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from atlas_tracking.receipts.state1 import set_margin
from atlas_tracking.testing.bench import cpu_usage, gate_bench_inputs, plain_forward, write_result

HERE = Path(__file__).resolve().parent
LAYERS, EXPERTS, TOP_K, WINDOWS, BATCH = 24, 128, 8, 32, 8
ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)
SIZE_BINS = ((1, 4), (5, 16), (17, 64), (65, 1 << 30))


def routed_counts(model: torch.nn.Module, canary: Any, batch: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Per routed layer and micro-batch of a plain forward: (layer, active rows per expert, adjacent competitors'
    rows per expert), from the router's own output (logits, weights, top-k index)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    routers = [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]

    def hook(layer: int):
        def read(_module: torch.nn.Module, _inputs: Any, out: Any) -> None:
            logits, _, index = out
            adjacent = set_margin(logits.float(), index.long()).e_k1
            seen.append((layer, torch.bincount(index.reshape(-1), minlength=EXPERTS),
                         torch.bincount(adjacent, minlength=EXPERTS)))
        return read

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    try:
        plain_forward(model, canary, batch)
    finally:
        for h in handles:
            h.remove()
    return seen


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each routed layer's fused experts module."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    return [m for m in model.modules() if isinstance(m, Qwen3MoeExperts)]


def per_expert(experts: torch.nn.Module) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The per-expert right-hand matrices of the two projections, as the expert-by-expert products read them
    (``adapters/grouped_experts._expert_by_expert``)."""
    pick = (lambda w: w.detach()) if experts.is_transposed else (lambda w: w.detach().transpose(-2, -1))
    return pick(experts.gate_up_proj).unbind(0), pick(experts.down_proj).unbind(0)


def pooled(counts: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
    """``counts`` summed over each routed layer's micro-batches: one product per expert and layer, not per micro-batch.

    >>> pooled([(0, torch.tensor([1, 0])), (1, torch.tensor([2, 2])), (0, torch.tensor([3, 1]))])
    [(0, tensor([4, 1])), (1, tensor([2, 2]))]
    """
    layers = sorted({layer for layer, _ in counts})
    return [(layer, sum(c for i, c in counts if i == layer)) for layer in layers]


def expert_by_expert(layers: list[torch.nn.Module], counts: list[tuple[int, torch.Tensor]], width: int) -> None:
    """Every expert's two products for ``counts`` rows, one ``torch.mm`` each, in each routed layer and micro-batch
    (the gate's way where an expert's weights are at least ``INTERLEAVE_BYTES``: widths of 128 and more here)."""
    weights = [per_expert(experts) for experts in layers]
    most = int(max(c.max() for _, c in counts))
    up_rows, down_rows = torch.randn(most, width), torch.randn(most, weights[0][1][0].shape[0])
    for layer, rows in counts:
        gate_up, down = weights[layer]
        for e, m in enumerate(rows.tolist()):
            if m:
                torch.mm(up_rows[:m], gate_up[e])
                torch.mm(down_rows[:m], down[e])


def grouped(layers: list[torch.nn.Module], counts: list[tuple[int, torch.Tensor]], width: int) -> None:
    """The same products as two grouped products per routed layer and micro-batch, transformers' ``_grouped_linear``
    (the gate's way for smaller experts: width 64 here)."""
    from transformers.integrations.moe import _grouped_linear

    most = int(max(c.sum() for _, c in counts))
    up_rows = torch.randn(most, width)
    for layer, rows in counts:
        experts = layers[layer]
        offsets = torch.cumsum(rows, 0, dtype=torch.int32)
        n = int(rows.sum())
        hidden = _grouped_linear(up_rows[:n], experts.gate_up_proj, offsets, is_transposed=experts.is_transposed)
        _grouped_linear(hidden[:, : hidden.shape[1] // 2].contiguous(), experts.down_proj, offsets,
                        is_transposed=experts.is_transposed)


WAYS = {"expert_by_expert": expert_by_expert, "grouped": grouped}
"""The two ways a gate's products run on a CPU (``adapters/grouped_experts.py``)."""


def per_row_microseconds(weights: tuple[torch.Tensor, ...], repeats: int = 200) -> dict[int, float]:
    """Microseconds per row of one product of M rows by one expert's matrix, for each M of ``ROW_COUNTS``."""
    w = weights[0]
    out = {}
    for m in ROW_COUNTS:
        x = torch.randn(m, w.shape[0])
        for _ in range(10):
            torch.mm(x, w)
        t0 = time.perf_counter()
        for _ in range(repeats):
            torch.mm(x, w)
        out[m] = round((time.perf_counter() - t0) / repeats / m * 1e6, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="default benchmarks/competitor_products_w{width}.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, canary = gate_bench_inputs(args.width, LAYERS, EXPERTS, TOP_K, WINDOWS)
    seen = routed_counts(model, canary, BATCH)
    layers = experts_modules(model)
    rows = {"active": [(layer, a) for layer, a, _ in seen], "competitors": [(layer, c) for layer, _, c in seen]}
    rows["competitors_pooled"] = pooled(rows["competitors"])
    passes = {f"{part}_{name}": (lambda way=way, part=part: way(layers, rows[part], args.width))
              for name, way in WAYS.items() for part in rows}
    for run in passes.values():  # the warm-up
        run()
    user = {name: [u["user"] for u in us] for name, us in cpu_usage(passes, args.repeats).items()}
    shares = {f"{part}_{name}": [c / a for a, c in zip(user[f"active_{name}"], user[f"{part}_{name}"])]
              for name in WAYS for part in ("competitors", "competitors_pooled")}
    adjacent = rows["competitors"]
    sizes = torch.stack([c for _, c in adjacent]).reshape(-1)
    rows_in = {f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+": int(sizes[(sizes >= lo) & (sizes <= hi)].sum())
               for lo, hi in SIZE_BINS}
    result = {
        "width": args.width, "layers": LAYERS, "experts": EXPERTS, "top_k": TOP_K, "canary_windows": WINDOWS,
        "batch_windows": BATCH, "torch_threads": 1, "repeats": args.repeats,
        "user_seconds_median": {name: statistics.median(ts) for name, ts in user.items()},
        "rows": {part: int(sum(int(c.sum()) for _, c in counts)) for part, counts in rows.items()},
        "rows_share": 1 / TOP_K,
        "time_share": {name: statistics.median(r) for name, r in shares.items()},
        "time_share_spread": {name: [min(r), max(r)] for name, r in shares.items()},
        "competitor_rows_by_product_rows": rows_in,
        "products": {part: int(sum(int((c > 0).sum()) for _, c in counts)) for part, counts in rows.items()},
        "microseconds_per_row": dict(zip(("gate_up", "down"), map(per_row_microseconds, per_expert(layers[0])))),
    }
    write_result(result, args.out or HERE / f"competitor_products_w{args.width}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
