"""How well near-tie mass predicts the routing mismatch two engines really show.

``python benchmarks/near_tie_prediction.py`` writes ``benchmarks/near_tie_prediction.json`` (section (p) of
``benchmarks/RESULTS.md``; the table in docs/rollout.md). Per family, ``--seeds`` tiny random models of
transformers' own code (``family_model``: width 64, 4 decoder layers, 16 routed experts unless said, byte
vocabulary), each over its own batch of ``--batch`` x ``--seq`` prose byte tokens. The trainer is the fp32 model;
the rollout engine is a copy of it cast whole to bf16 (``copy.deepcopy(model).to(torch.bfloat16)``), and separately
to fp16; the engine's routes are ``trainer_routes(copy, ids, mask)`` and the comparison is
``rollout_agreement(fp32_model, ids, routes)``. Everything runs on the CPU, one torch thread, so both engines are
deterministic.

What is compared, per family, engine precision and routed layer:

- ``mismatch``: the share of positions whose two active sets differ (what near-tie mass would predict);
- ``near_tie``: the shares of positions whose fp32 set margin is within bf16's and fp16's rounding of a tie,
  ``|m| <= eps (|s_k| + |s_k1|)`` (the near-tie mass, as a gate reads it: computed from the trainer alone, before
  any rollout is seen);
- ``boundary_mass`` and ``perturbation``: the share of positions within the median relative gap the engines
  actually showed, and that gap's quantiles (these use the measured mismatch, so they are a description of it,
  not an independent prediction);
- from the per-position fields (``read_agreement``, the same forward ``rollout_agreement`` summarises; the two are
  checked equal): ``explained``, the share of mismatched positions that were near ties at the engine's precision
  (how much of the mismatch near-tie mass covers); ``flipped``, the share of near-tie positions that mismatched;
  ``unselectable``, the mismatched positions where the rollout chose an expert the trainer's router could not
  select at all (outside its eligible groups: an infinite gap); ``clean_mismatch``, the mismatch among positions
  whose earlier routed layers all agreed (the rest can follow from a different hidden state, not a near tie).

Pooled figures add the counts of every seed (and, per family, of every layer); the prediction summary per family
and precision is over the (layer, seed) points: the ratio mismatch / near-tie mass, whether near-tie mass is above
the mismatch at every point (an upper bound), below it at every point (a lower bound) or neither, and Spearman's
rank correlation of the two over the points; across families, the same over the families' pooled figures.
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.stats import spearmanr

from atlas_tracking import rollout_agreement
from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.engine.rollout import read_agreement, summarize, trainer_routes
from atlas_tracking.receipts.rollout import PRECISIONS, layer_agreement
from atlas_tracking.receipts.state1 import NEAR_TIE_DTYPES
from atlas_tracking.testing.bench import write_result
from atlas_tracking.testing.demo_data import encode, prose_text
from atlas_tracking.testing.families import family_model

HERE = Path(__file__).resolve().parent
WIDER = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4)
"""What every family gets beyond its tiny config (families.CONFIGS): width 64, 4 decoder layers, byte vocabulary."""
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(overrides=dict(num_experts=16, moe_intermediate_size=32, head_dim=16),
                      routing="softmax, top-2 of 16"),
    "mixtral": dict(overrides=dict(num_local_experts=16, head_dim=16), routing="top-2 of 16 logits, softmax over them"),
    "deepseek_v3": dict(overrides=dict(n_routed_experts=16, moe_intermediate_size=32, num_hidden_layers=5),
                        routing="sigmoid + bias, group-limited (4 groups of 4, top-2 groups), top-2; first layer dense"),
    "longcat_flash": dict(overrides=dict(n_routed_experts=16, num_hidden_layers=8, expert_ffn_hidden_size=32,
                                         ffn_hidden_size=96),
                          routing="softmax over 16 experts + 2 zero experts, top-2 (4 layers of two sublayers)"),
    "gpt_oss": dict(overrides=dict(num_local_experts=16, intermediate_size=32, head_dim=16),
                    routing="top-2 of 16 logits (with router bias), softmax over them"),
    "llama4_text": dict(overrides=dict(num_local_experts=16, num_experts_per_tok=1, intermediate_size=32,
                                       intermediate_size_mlp=96, head_dim=16),
                        routing="top-1 of 16 logits, sigmoid gate"),
}
ENGINES = {"bf16": torch.bfloat16, "fp16": torch.float16}
EPS = {name: float(torch.finfo(dtype).eps) for name, dtype in NEAR_TIE_DTYPES.items()}


def prose_batch(batch: int, seq: int, seed: int) -> torch.Tensor:
    prose = encode(prose_text())
    starts = np.random.default_rng(seed).integers(0, len(prose) - seq, size=batch)
    return torch.from_numpy(np.stack([prose[s:s + seq] for s in starts]).astype(np.int64))


def share(count: float, total: float) -> float | None:
    return round(float(count) / total, 6) if total else None


def extras(usable: np.ndarray, overlap: np.ndarray, margin: np.ndarray, gap: np.ndarray, near_tie: np.ndarray,
           clean: np.ndarray, k: int, precision: str) -> dict[str, float]:
    """Counts from one layer's per-position fields (summable over seeds): mismatched positions that were near ties
    at ``precision`` (the readout's own near-tie flags), near ties, near ties that mismatched, mismatched positions with an infinite gap, and the mismatch
    among ``clean`` positions (every earlier routed layer agreed)."""
    mism = usable & (overlap != k)
    near = usable & np.isfinite(margin) & near_tie[PRECISIONS.index(precision)]
    return {"mismatched": int(mism.sum()), "explained": int((mism & near).sum()), "near_ties": int(near.sum()),
            "unselectable": int((mism & np.isinf(gap)).sum()),
            "clean": int((usable & clean).sum()), "clean_mismatched": int((mism & clean).sum())}


def extra_shares(c: dict[str, float]) -> dict[str, float | None]:
    return {"explained": share(c["explained"], c["mismatched"]), "flipped": share(c["explained"], c["near_ties"]),
            "unselectable": share(c["unselectable"], c["mismatched"]),
            "clean_mismatch": share(c["clean_mismatched"], c["clean"])}


def row_of(agreement: dict[str, Any]) -> dict[str, Any]:
    """What the tables read from one layer's agreement."""
    p = agreement["perturbation"]
    return {"compared": agreement["compared"], "mismatched": agreement["mismatched"], "mismatch": agreement["mismatch"],
            "near_tie": agreement["near_tie"], "boundary_mass": agreement["boundary_mass"],
            "perturbation_median": None if p is None else p["median"],
            "perturbation_p90": None if p is None else p["p90"]}


def spearman(x: list[float | None], y: list[float | None]) -> dict[str, Any]:
    pairs = [(a, b) for a, b in zip(x, y) if a is not None and b is not None]
    if len(pairs) < 3 or len({a for a, _ in pairs}) < 2 or len({b for _, b in pairs}) < 2:
        return {"rho": None, "p": None, "points": len(pairs)}
    rho, p = spearmanr([a for a, _ in pairs], [b for _, b in pairs])
    return {"rho": round(float(rho), 3), "p": round(float(p), 4), "points": len(pairs)}


def bound(mismatch: list[float], near: list[float]) -> dict[str, Any]:
    """Whether near-tie mass is above the mismatch at every point, below at every point, or neither."""
    above = sum(n >= m for m, n in zip(mismatch, near))
    below = sum(n <= m for m, n in zip(mismatch, near))
    kind = "upper bound" if above == len(near) else "lower bound" if below == len(near) else "neither"
    return {"kind": kind, "points": len(near), "near_tie_above": above, "near_tie_below": below}


def run_family(name: str, seeds: list[int], batch: int, seq: int) -> dict[str, Any]:
    spec = FAMILIES[name]
    overrides = {**WIDER, **spec["overrides"]}
    per_seed: dict[str, list[dict[str, Any]]] = {p: [] for p in ENGINES}
    fields: dict[str, list[list[tuple[np.ndarray, ...]]]] = {p: [] for p in ENGINES}
    """Per engine, seed and layer: the readout's five per-position fields (``near_tie`` is ``[precisions, N]``)."""
    counts: dict[str, list[list[dict[str, float]]]] = {p: [] for p in ENGINES}
    info: dict[str, Any] = {}
    for seed in seeds:
        model = family_model(name, seed=seed, **overrides)
        layers = find_routed_layers(model)
        info = {"routing": spec["routing"], "overrides": overrides, "layers": [int(la.index) for la in layers],
                "experts": int(layers[0].num_experts), "top_k": int(layers[0].top_k),
                "parameters": sum(p.numel() for p in model.parameters())}
        ids = prose_batch(batch, seq, seed)
        mask = torch.ones_like(ids)
        for precision, dtype in ENGINES.items():
            engine = copy.deepcopy(model).to(dtype)
            routes = trainer_routes(engine, ids, mask)
            del engine
            result = rollout_agreement(model, ids, routes, attention_mask=mask)
            readout = read_agreement(model, ids, routes, mask)
            if summarize(readout, across_processes=False) != result:
                raise AssertionError(f"{name} seed {seed} {precision}: the readout does not summarise to the result")
            usable, overlap, margin, gap, near_tie = readout.fields
            ks = np.array([int(la.top_k) for la in layers])[:, None]
            mism = usable & (overlap != ks)
            earlier = np.vstack([np.zeros((1, mism.shape[1]), bool), np.cumsum(mism, 0)[:-1] > 0])
            layer_fields, layer_counts = [], []
            for i, la in enumerate(layers):
                f = (usable[i], overlap[i], margin[i], gap[i], near_tie[i])
                c = extras(*f, clean=~earlier[i], k=int(la.top_k), precision=precision)
                layer_fields.append(f)
                layer_counts.append(c)
                per_seed[precision].append({"seed": seed, "layer": int(la.index), **row_of(result["layers"][i]),
                                            **extra_shares(c)})
            fields[precision].append(layer_fields)
            counts[precision].append(layer_counts)
    out: dict[str, Any] = {**info, "engines": {}}
    mask_all = np.ones(batch * seq * len(seeds), bool)
    k = info["top_k"]
    for precision in ENGINES:
        pooled_layers = []
        for i, layer in enumerate(info["layers"]):
            f = [np.concatenate([fields[precision][s][i][j] for s in range(len(seeds))], axis=-1) for j in range(5)]
            c = {key: sum(counts[precision][s][i][key] for s in range(len(seeds))) for key in counts[precision][0][i]}
            pooled_layers.append({"layer": layer, **row_of(layer_agreement(*f, mask=mask_all, k=k)),
                                  **extra_shares(c)})
        f = [np.concatenate([fields[precision][s][i][j] for s in range(len(seeds)) for i in range(len(info["layers"]))],
                            axis=-1) for j in range(5)]
        c = {key: sum(cc[key] for layer_c in counts[precision] for cc in layer_c) for key in counts[precision][0][0]}
        whole = {**row_of(layer_agreement(*f, mask=np.ones(len(f[0]), bool), k=k)), **extra_shares(c)}
        points = per_seed[precision]
        mismatch = [p["mismatch"] for p in points]
        near = [p["near_tie"][precision] for p in points]
        out["engines"][precision] = {
            "pooled": whole,
            "layers": pooled_layers,
            "per_seed": points,
            "prediction": {
                "ratio_mismatch_over_near_tie": share(whole["mismatch"], whole["near_tie"][precision]),
                "ratio_per_point": spread([m / n for m, n in zip(mismatch, near) if n]),
                "perturbation_median_over_eps": None if whole["perturbation_median"] is None
                else round(whole["perturbation_median"] / EPS[precision], 4),
                "bound": bound(mismatch, near),
                "spearman_near_tie": spearman(near, mismatch),
                "spearman_near_tie_clean": spearman(near, [p["clean_mismatch"] for p in points]),
                "spearman_boundary_mass": spearman([p["boundary_mass"] for p in points], mismatch),
                "spearman_layer_depth": spearman([float(p["layer"]) for p in points], mismatch),
            },
        }
    return out


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    q = np.quantile(values, [0.0, 0.25, 0.5, 0.75, 1.0])
    return dict(zip(("min", "q1", "median", "q3", "max"), (round(float(v), 4) for v in q)))


def across(families: dict[str, Any]) -> dict[str, Any]:
    """Per precision, over the families' pooled figures and over every (family, layer) pooled over seeds."""
    out = {}
    for precision in ENGINES:
        whole = [f["engines"][precision]["pooled"] for f in families.values()]
        layers = [row for f in families.values() for row in f["engines"][precision]["layers"]]
        out[precision] = {
            "families": spearman([w["near_tie"][precision] for w in whole], [w["mismatch"] for w in whole]),
            "family_layers": spearman([r["near_tie"][precision] for r in layers], [r["mismatch"] for r in layers]),
            "family_layers_bound": bound([r["mismatch"] for r in layers], [r["near_tie"][precision] for r in layers]),
            "ratio_by_family": {name: f["engines"][precision]["prediction"]["ratio_mismatch_over_near_tie"]
                                for name, f in families.items()},
        }
    return out


def fmt(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(families: dict[str, Any]) -> str:
    """The pooled figures per family and engine, as a plain-text table."""
    head = ("family", "engine", "mismatch", "clean", "near-tie", "ratio", "explained", "flipped", "boundary",
            "pert/eps", "unselectable", "bound", "rho")
    lines = ["  ".join(f"{h:>12s}" for h in head)]
    for name, f in families.items():
        for precision in ENGINES:
            e = f["engines"][precision]
            w, p = e["pooled"], e["prediction"]
            cells = (name, precision, fmt(w["mismatch"]), fmt(w["clean_mismatch"]), fmt(w["near_tie"][precision]),
                     fmt(p["ratio_mismatch_over_near_tie"], 3), fmt(w["explained"], 3), fmt(w["flipped"], 3),
                     fmt(w["boundary_mass"]), fmt(p["perturbation_median_over_eps"], 3), fmt(w["unselectable"], 3),
                     p["bound"]["kind"], str(p["spearman_near_tie"]["rho"]))
            lines.append("  ".join(f"{c:>12s}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default=str(HERE / "near_tie_prediction.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    result: dict[str, Any] = {
        "commit": commit.stdout.strip() or None, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "seeds": args.seeds, "batch": args.batch, "seq": args.seq,
        "tokens_per_seed": args.batch * args.seq, "eps": EPS,
        "trainer": "the fp32 model", "engines": "a copy cast whole to bf16 / fp16 (copy.deepcopy(model).to(dtype))",
        "families": {},
    }
    for name in args.families:
        print(f"{name} ...", flush=True)
        result["families"][name] = run_family(name, list(range(args.seeds)), args.batch, args.seq)
    result["across_families"] = across(result["families"])
    write_result(result, args.out)
    print(table(result["families"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
