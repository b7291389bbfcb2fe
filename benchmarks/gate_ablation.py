"""What each part of a gate costs at most: the gate with that part replaced by a stand-in, in user seconds.

``python benchmarks/gate_ablation.py --width 256`` writes ``benchmarks/gate_ablation_w256.json``: for a freshly
initialised Qwen3-MoE (24 routed layers x 128 experts, k = 8, float32, ``--width`` wide) over a 32 x 128-token canary
in micro-batches of 8 windows, the user seconds of a plain no-grad forward, of a gate (no baseline, eager field
arithmetic) and of the gate with parts replaced by stand-ins that cost nothing: the competitors' and the self-check
sample's products (``pairs``: the active fields still come from the experts' own products; the pooled competitors'
call too), the field arithmetic (``chunk``: the chunks' and the competitors' distances, pooled or not), the re-route
for ``ov_cf`` (``reroute``), the per-window sums with the re-route (``compute``), the self-check's comparisons
(``observe``), and all of them at once (``all``). The stand-ins return zeros, so those gates' receipts are wrong and
their self-check is not judged: a benchmark-only instrument, for timing alone. One process, one torch thread, the
passes interleaved, the medians of ``--repeats`` of each pass's ratio to the plain forward next to it. User seconds:
the system seconds of page faults land on whichever pass finds freed memory gone (``gate_fresh_processes.py``).
Results in ``benchmarks/RESULTS.md`` (v).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from atlas_tracking import AtlasConfig, measure
from atlas_tracking.adapters.hf import HFLayer
from atlas_tracking.engine import capture, kernels, pooled_competitors, selfcheck
from atlas_tracking.engine import measure as measure_module
from atlas_tracking.receipts.field_chunk import ChunkReceipts
from atlas_tracking.testing.bench import cpu_usage, gate_bench_inputs, plain_forward, write_result

HERE = Path(__file__).resolve().parent
LAYERS, EXPERTS, TOP_K, WINDOWS, BATCH = 24, 128, 8, 32, 8


_GROUPED_CALL = capture.LayerCapture._grouped_call
"""The capture's own grouped call, which the ``pairs`` stand-in makes for the active rows alone."""


def _active_only(self: capture.LayerCapture, hidden: torch.Tensor, index: torch.Tensor,
                 pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    grouped = _GROUPED_CALL(self, hidden, index, [])
    return None if grouped is None else (grouped[0], [hidden.new_zeros((*e.shape, hidden.shape[-1])) for _, e in pairs])


def _zero_chunk(self: kernels.ChunkKernels, setting: str, u: torch.Tensor, *args: Any, **kwargs: Any
                ) -> tuple[ChunkReceipts, str]:
    n, _, d = u.shape
    zeros = torch.zeros(n, device=u.device)
    return ChunkReceipts(zeros, torch.ones(n, dtype=torch.bool, device=u.device), u.new_zeros((n, d)).float(),
                         zeros, zeros, None, u.new_zeros((n, d)).float()), "eager"


def _zero_adjacent(u_adj: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    zeros = torch.zeros(len(u_adj), device=u_adj.device)
    return zeros, zeros


def _zero_random(u_rand: torch.Tensor, zh: torch.Tensor, v_k: torch.Tensor, b_pos: torch.Tensor, eps_d: float
                 ) -> torch.Tensor:
    return torch.zeros(len(b_pos), device=b_pos.device)


def _zero_pairs(self: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    return [rows.new_zeros((*e.shape, rows.shape[-1])) for rows, e in pairs]


def _no_reroute(self: Any, g: torch.Tensor) -> torch.Tensor:
    return torch.zeros(g.reshape(-1, g.shape[-1]).shape[0], self.top_k, dtype=torch.long, device=g.device)


def _stash_only(self: capture.LayerCapture, x: torch.Tensor, g: torch.Tensor, router_out: Any, out: torch.Tensor,
                stash: Any = None) -> Any:
    return stash


def _summaries_only(layers: list[Any], hosts: list[dict[str, Any]], owned: list[Any], fallbacks: list[Any]
                    ) -> list[dict[str, Any]]:
    return [selfcheck.layer_summary(host, owned, fallbacks) for host in hosts]


STAND_INS: dict[str, list[tuple[Any, str, Any]]] = {
    "pairs": [(capture.LayerCapture, "_grouped_call", _active_only), (HFLayer, "grouped_pair_outputs", _zero_pairs)],
    "chunk": [(kernels.ChunkKernels, "__call__", _zero_chunk), (pooled_competitors, "adjacent_receipts", _zero_adjacent),
              (pooled_competitors, "random_distance", _zero_random), (capture, "random_distance", _zero_random)],
    "reroute": [(HFLayer, "route_active", _no_reroute)],
    "compute": [(capture.LayerCapture, "compute", _stash_only)],
    "observe": [(selfcheck.SelfCheck, "observe", lambda self, *a, **k: None)],
}
"""Each part's stand-ins: (class or module, attribute, replacement)."""
STAND_INS["all"] = [s for part in ("pairs", "chunk", "compute", "observe") for s in STAND_INS[part]]


@contextlib.contextmanager
def standing_in(part: str) -> Iterator[None]:
    """``part``'s stand-ins in place (and the self-check's verdict not judged) for the ``with`` block."""
    replaced = [*STAND_INS[part], (measure_module, "check_layers", _summaries_only)]
    saved = [(cls, name, getattr(cls, name)) for cls, name, _ in replaced]
    try:
        for cls, name, fn in replaced:
            setattr(cls, name, fn)
        yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--parts", nargs="+", default=list(STAND_INS), choices=list(STAND_INS))
    ap.add_argument("--out", default=None, help="default benchmarks/gate_ablation_w{width}.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, canary = gate_bench_inputs(args.width, LAYERS, EXPERTS, TOP_K, WINDOWS)
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "kernels": "eager", "batch_windows": BATCH}})

    def gate(part: str | None) -> None:
        with standing_in(part) if part else contextlib.nullcontext():
            measure(model, canary, config=cfg, keep_anchors=False)

    passes = {"plain": lambda: plain_forward(model, canary, BATCH), "gate": lambda: gate(None)}
    passes.update({f"without_{part}": (lambda part=part: gate(part)) for part in args.parts})
    for run in passes.values():  # the warm-up
        run()
    user = {name: [u["user"] for u in us] for name, us in cpu_usage(passes, args.repeats).items()}
    ratios = {name: [t / p for t, p in zip(ts, user["plain"])] for name, ts in user.items() if name != "plain"}
    result = {
        "width": args.width, "layers": LAYERS, "experts": EXPERTS, "top_k": TOP_K, "canary_windows": WINDOWS,
        "batch_windows": BATCH, "kernels": "eager", "torch_threads": 1, "repeats": args.repeats,
        "user_seconds_median": {name: statistics.median(ts) for name, ts in user.items()},
        "over_plain_forward": {name: statistics.median(r) for name, r in ratios.items()},
        "over_plain_forward_spread": {name: [min(r), max(r)] for name, r in ratios.items()},
    }
    write_result(result, args.out or HERE / f"gate_ablation_w{args.width}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
