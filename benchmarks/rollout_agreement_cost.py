"""What ``rollout_agreement`` costs per rollout token, against the trainer's own forward on the same batch.

``python benchmarks/rollout_agreement_cost.py`` writes ``benchmarks/rollout_agreement_cost.json`` (section (p) of
``benchmarks/RESULTS.md``). One process, one torch thread; per shape, one fp32 model in eval mode (the trainer) and
one batch of ``--batch`` x ``--seq`` prose byte tokens, its attention mask all ones. The rollout engine is a bf16
copy of the model: its routed experts (``trainer_routes`` of the copy, ``[batch, seq, routed layers, k]``) and its
log-probabilities of the tokens (from its logits) are made once, before any timing, so the comparison meets the
mismatches two engines really show (their count is in the JSON).

Three passes, interleaved, their order rotated at every repeat (so no pass always runs first or after the same
one):

- ``forward``: the trainer's own no-grad forward on the batch (``model(input_ids, attention_mask, use_cache=False)``,
  the call ``rollout_agreement`` makes);
- ``agreement``: ``rollout_agreement(model, ids, routes, attention_mask=mask)``;
- ``agreement_logprobs``: the same with ``rollout_logprobs`` (the trainer's log-probabilities are then taken from the
  forward's logits, one sequence at a time);

and, for reference, in a block of its own (a backward frees its gradients and activations, which would make the pass
after it slower), a training forward and backward on the batch (``labels=ids``; gradients dropped after each pass)
interleaved with the no-grad forward, alternating which comes first.

Times are CPU seconds of the process (``time.process_time``: the machine is shared); wall seconds are in the JSON.
Per pass: the median and quartiles over the shape's repeats (21, 11 and 7; ``--repeats`` sets all); per ratio, the
median and quartiles of each repeat's own ratio (a pass against the forward run in the same repeat), and the ratio
of the medians. ``summarize`` alone (the host-side reduction of one forward's comparison, on a prepared readout) is
timed on its own.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atlas_tracking import rollout_agreement
from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.engine.rollout import read_agreement, summarize, trainer_routes
from atlas_tracking.testing.bench import write_result
from atlas_tracking.testing.demo_data import encode, prose_text
from atlas_tracking.testing.lightning_lm import build_qwen3_moe

HERE = Path(__file__).resolve().parent
SHAPES: dict[str, dict[str, Any]] = {
    "demo": dict(kw={}, repeats=21, what="the demo model as built (build_qwen3_moe(): width 64, 4 routed layers x "
                                         "32 experts, top-2, byte vocabulary, router aux loss on)"),
    "24x128": dict(kw=dict(layers=24, experts=128, top_k=8, aux_coef=0.0), repeats=11,
                   what="width 64, 24 routed layers x 128 experts, top-8, byte vocabulary"),
    "wide": dict(kw=dict(hidden=1024, layers=2, experts=16, top_k=4, aux_coef=0.0), repeats=7,
                 what="width 1024, 2 routed layers x 16 experts, top-4, byte vocabulary"),
}
"""The shapes measured, each with its default number of repeats (fewer where a pass takes seconds)."""


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles and extremes of a list."""
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": min(values), "max": max(values)}


def prose_batch(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """``batch`` windows of ``seq`` prose byte tokens."""
    prose = encode(prose_text())
    starts = np.random.default_rng(seed).integers(0, len(prose) - seq, size=batch)
    return torch.from_numpy(np.stack([prose[s:s + seq] for s in starts]).astype(np.int64))


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` log-probability of each token given the ones before it (position 0: NaN), fp32."""
    out = torch.full(ids.shape, float("nan"))
    out[:, 1:] = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, ids[:, 1:, None]).squeeze(2)
    return out


def interleaved(passes: dict[str, Callable[[], Any]], repeats: int) -> dict[str, dict[str, list[float]]]:
    """CPU and wall seconds of each pass, ``repeats`` times, the passes' order rotated by one at every repeat."""
    names = list(passes)
    times: dict[str, dict[str, list[float]]] = {"cpu": {n: [] for n in names}, "wall": {n: [] for n in names}}
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            c0, w0 = time.process_time(), time.perf_counter()
            passes[name]()
            times["cpu"][name].append(time.process_time() - c0)
            times["wall"][name].append(time.perf_counter() - w0)
    return times


def one_shape(name: str, batch: int, seq: int, repeats: int, summarize_calls: int) -> dict[str, Any]:
    spec = SHAPES[name]
    model = build_qwen3_moe(seed=0, **spec["kw"]).eval()
    layers = find_routed_layers(model)
    ids = prose_batch(batch, seq)
    mask = torch.ones_like(ids)
    tokens = batch * seq
    rollout = copy.deepcopy(model).to(torch.bfloat16)
    routes = trainer_routes(rollout, ids, mask)
    with torch.no_grad():
        rollout_lp = token_logprobs(rollout(input_ids=ids, attention_mask=mask, use_cache=False).logits, ids)
    del rollout
    check = rollout_agreement(model, ids, routes, attention_mask=mask, rollout_logprobs=rollout_lp)

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False)

    def forward_backward() -> None:
        model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    passes = {
        "forward": forward,
        "agreement": lambda: rollout_agreement(model, ids, routes, attention_mask=mask),
        "agreement_logprobs": lambda: rollout_agreement(model, ids, routes, attention_mask=mask,
                                                        rollout_logprobs=rollout_lp),
    }
    for run in passes.values():  # warm-up
        run()
    times = interleaved(passes, repeats)
    forward_backward()
    reference = interleaved({"forward": forward, "forward_backward": forward_backward}, repeats)
    readout = read_agreement(model, ids, routes, mask)
    c0 = time.process_time()
    for _ in range(summarize_calls):
        summarize(readout, across_processes=False)
    summarize_ms = 1000 * (time.process_time() - c0) / summarize_calls

    cpu, ref = times["cpu"], reference["cpu"]
    med = {k: statistics.median(v) for k, v in cpu.items()}

    def paired(a: str, b: str, f: Callable[[float, float], float]) -> dict[str, float]:
        return spread([f(x, y) for x, y in zip(cpu[a], cpu[b])])

    return {
        "model": spec["what"], "parameters": sum(p.numel() for p in model.parameters()),
        "routed_layers": len(layers), "experts": int(layers[0].num_experts), "top_k": int(layers[0].top_k),
        "batch": batch, "seq": seq, "tokens": tokens, "repeats": repeats,
        "measured": {"mismatch_by_layer": [row["mismatch"] for row in check["layers"]],
                     "first_mismatch_none": check["first_mismatch"]["none"], "logprobs": check["logprobs"]},
        "ms": {clock: {k: spread([1000 * s for s in v]) for k, v in t.items()} for clock, t in times.items()},
        "ratio_of_medians": {k: med[k] / med["forward"] for k in ("agreement", "agreement_logprobs")},
        "ratio_paired": {k: paired(k, "forward", lambda a, b: a / b) for k in ("agreement", "agreement_logprobs")},
        "reference_ms": {clock: {k: spread([1000 * s for s in v]) for k, v in t.items()}
                         for clock, t in reference.items()},
        "forward_backward_over_forward_paired": spread([a / b for a, b in zip(ref["forward_backward"],
                                                                              ref["forward"])]),
        "agreement_over_forward_backward": med["agreement"] / statistics.median(ref["forward_backward"]),
        "us_per_token": {"agreement": spread([1e6 * s / tokens for s in cpu["agreement"]]),
                         "agreement_over_forward_paired": paired("agreement", "forward",
                                                                 lambda a, b: 1e6 * (a - b) / tokens)},
        "logprobs_extra_ms_paired": paired("agreement_logprobs", "agreement", lambda a, b: 1000 * (a - b)),
        "summarize_ms": summarize_ms, "summarize_calls": summarize_calls,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=None, help="repeats of every shape (default: the shape's own)")
    ap.add_argument("--summarize-calls", type=int, default=50)
    ap.add_argument("--out", default=str(HERE / "rollout_agreement_cost.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    result: dict[str, Any] = {
        "commit": commit.stdout.strip() or None, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "clock": "CPU seconds of the process (time.process_time)",
        "rollout_engine": "a bf16 copy of the fp32 model: its routed experts and its log-probabilities",
        "shapes": {},
    }
    for name in args.shapes:
        print(f"{name} ...", flush=True)
        result["shapes"][name] = one_shape(name, args.batch, args.seq, args.repeats or SHAPES[name]["repeats"],
                                            args.summarize_calls)
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
