"""GRPO on a small MoE, rollouts in bf16 and updates in fp32, once without and once with routing replay:
``python examples/grpo_replay.py [--steps N] [--out DIR]``.

A plain reinforcement-learning loop on the CPU in about a minute, with the rollout agreement recorded every step
(docs/rollout.md#a-recipe-grpo-with-and-without-routing-replay):

1. The policy: a random-weight Qwen3-MoE (transformers' own architecture, the byte vocabulary of the demo; 4 routed
   layers, 32 experts, top-4, width 64) in fp32. The rollout engine: a bf16 copy of it, its weights synced from the
   policy at every step, as an inference engine serving bf16 weights would be.
2. Each step the engine samples ``--group`` completions of ``--new-tokens`` bytes for each of ``--prompts`` prompts
   (byte windows of the Python documentation's prose); the reward is verifiable: the share of a completion's bytes
   that are lowercase ASCII letters (about a tenth of a random byte model's samples). The engine's routed experts
   for prompt and completion are read with :func:`~atlas_tracking.engine.rollout.trainer_routes` and its
   log-probabilities of the sampled bytes from its bf16 logits, in one forward.
3. The update is GRPO's in fp32: group-normalised advantages, the clipped ratio against the rollout's log-probabilities,
   averaged over completion tokens, plus Qwen3-MoE's own load-balancing loss (``--aux-coef``; it counts the router's
   own top-k, replayed or not); one Adam step per rollout batch.
4. Two runs from the same weights and seeds: ``no_replay`` (the update routes the tokens itself) and ``replay``
   (R3: a forward hook on each ``Qwen3MoeTopKRouter`` replaces its top-k indices with the rollout's and recomputes
   their weights from the router's own softmax, as the router does). ``gate.rollout`` reads every step with the
   replay hooked, so its agreement is that of the routing the update actually used. Each run has its own atlas run
   directory (``<out>/<run>/atlas``): a canary of held-out prose, the step-0 baseline gate and a gate every
   ``--every`` steps whose objective is the mean reward of the steps since the last gate, maximised.

At the end: the two runs side by side (printed, and ``<out>/compare.md``) and the mismatch per routed layer over steps
(``<out>/rollout_mismatch.png``). ``atlas-tracking report <out>/<run>/atlas --out report.html`` shows each run's
rollout agreement beside its gates.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atlas_tracking import AtlasGate, Canary
from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.artifacts.rollout_record import read_rollout
from atlas_tracking.artifacts.rollout_summary import summarize
from atlas_tracking.engine.rollout import trainer_routes
from atlas_tracking.testing.demo_data import VOCAB_SIZE, encode, prose_text

TARGET = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
TARGET[ord("a"):ord("z") + 1] = True
"""The bytes the reward counts: lowercase ASCII letters."""

RUNS = ("no_replay", "replay")
CONFIG: dict[str, Any] = {
    "receipts": {"progress": False, "n_bootstrap": 200, "anchors": 64},
    "policy": {"phase": "post_training"},   # gates read against the step-0 baseline (a random model reads as pretraining)
    "telemetry": {"enabled": False},        # this recipe is about the rollout; the training-batch load is docs/telemetry.md
    "objective": {"metric": "reward", "direction": "maximize"},
}
"""The atlas configuration of both runs (the keys of an ``atlas.yaml``)."""


def build_policy(seed: int = 0, hidden: int = 64, layers: int = 4, experts: int = 32, top_k: int = 4,
                 aux_coef: float = 0.0):
    """A random-weight Qwen3-MoE over the byte vocabulary (1.65M parameters as built here), fp32; with ``aux_coef``
    its forward returns the load-balancing loss (``aux_loss``)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, max_position_embeddings=256,
        tie_word_embeddings=True, output_router_logits=aux_coef > 0, router_aux_loss_coef=aux_coef)
    return Qwen3MoeForCausalLM(cfg)


def reward(completions: torch.Tensor) -> torch.Tensor:
    """``[n]``: the share of each completion's bytes that are lowercase ASCII letters (the verifiable reward)."""
    return TARGET[completions].float().mean(dim=1)


class RouteReplay:
    """Routing replay (R3) on a transformers Qwen3-MoE: while :meth:`replaying` a ``[batch, seq, layers, k]`` array,
    every routed layer's router returns the rollout's experts for the batch instead of its own top-k, with weights
    recomputed from its own softmax the way ``Qwen3MoeTopKRouter.forward`` does (the chosen experts' probabilities,
    renormalised when ``norm_topk_prob``), so the gradient still reaches the router. A position whose rollout route
    is not ``k`` distinct experts keeps the router's own choice and is counted in ``fallback``.

    The hooks are registered once, before the gate's, so every later hook (``gate.rollout``'s reads) sees the
    replayed choice."""

    def __init__(self, model: torch.nn.Module):
        self.routers = [layer.router for layer in find_routed_layers(model)]   # forward order, as trainer_routes
        self.routes: torch.Tensor | None = None
        self.fallback = 0
        self.handles = [router.register_forward_hook(self._hook(i)) for i, router in enumerate(self.routers)]

    def _hook(self, i: int):
        def replay(router: torch.nn.Module, args: tuple, output: tuple) -> tuple | None:
            if self.routes is None:
                return None
            logits, _, own = output
            given = self.routes[:, :, i].reshape(-1, own.shape[-1]).to(own.device)
            if given.shape != own.shape:
                raise ValueError(f"replay: the router saw {own.shape[0]} tokens, the routes cover {given.shape[0]}")
            ordered = given.sort(dim=-1).values
            usable = (given >= 0).all(-1) & (ordered[:, 1:] != ordered[:, :-1]).all(-1)
            index = torch.where(usable[:, None], given, own)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            weights = probs.gather(1, index)
            if router.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            self.fallback += int((~usable).sum())
            return logits, weights.to(logits.dtype), index
        return replay

    @contextmanager
    def replaying(self, routes: torch.Tensor | None) -> Iterator[None]:
        """Replay ``routes`` in every forward inside the block (None: the routers choose)."""
        self.routes = routes
        try:
            yield
        finally:
            self.routes = None


@torch.no_grad()
def sample(engine: torch.nn.Module, prompts: torch.Tensor, new_tokens: int, generator: torch.Generator) -> torch.Tensor:
    """Prompt and ``new_tokens`` bytes sampled at temperature 1 from the engine, with its KV cache."""
    out = engine(input_ids=prompts, use_cache=True)
    ids = prompts
    for t in range(new_tokens):
        probs = torch.softmax(out.logits[:, -1].float(), dim=-1)
        token = torch.multinomial(probs, 1, generator=generator)
        ids = torch.cat([ids, token], dim=1)
        if t + 1 < new_tokens:
            out = engine(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
    return ids


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq - 1]``: the log-probability the logits give each next token, in fp32."""
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(2, ids[:, 1:, None]).squeeze(2)


def rollout_view(engine: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's routed experts for ``ids`` (``[batch, seq, layers, k]``) and its log-probabilities of every
    token given the ones before it (``[batch, seq]``, NaN at position 0), from one bf16 forward."""
    kept: dict[str, torch.Tensor] = {}

    def forward(model, input_ids, attention_mask):
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        kept["logits"] = out.logits
        return out

    routes = trainer_routes(engine, ids, mask, forward=forward)
    logprobs = torch.full(ids.shape, float("nan"))
    logprobs[:, 1:] = token_logprobs(kept["logits"], ids)
    return routes, logprobs


def train(run: str, args: argparse.Namespace, prose: np.ndarray, canary: Canary) -> dict[str, Any]:
    """One GRPO run (``run`` in :data:`RUNS`); returns the per-step rewards and the gates."""
    replay_on = run == "replay"
    policy = build_policy(seed=args.seed, experts=args.experts, top_k=args.top_k, aux_coef=args.aux_coef)
    engine = build_policy(seed=args.seed, experts=args.experts, top_k=args.top_k).to(torch.bfloat16).eval()  # bf16
    replay = RouteReplay(policy)
    gate = AtlasGate(policy, canary, CONFIG, out_dir=Path(args.out) / run / "atlas")
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    rng = np.random.default_rng(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    train_part = prose[: int(0.9 * len(prose))]
    P, G = args.prompt_len, args.group
    rewards: list[float] = []
    gates = [gate.run(0, loss=None, loss_key="reward")]
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        engine.load_state_dict(policy.state_dict())            # sync: fp32 -> bf16 weights
        starts = rng.integers(0, len(train_part) - P, args.prompts)
        prompts = torch.from_numpy(np.stack([train_part[s:s + P] for s in starts])).repeat_interleave(G, dim=0)
        ids = sample(engine, prompts, args.new_tokens, generator)
        mask = torch.ones_like(ids)
        routes, rollout_lp = rollout_view(engine, ids, mask)
        r = reward(ids[:, P:])
        grouped = r.view(-1, G)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1, 1)
        rewards.append(float(r.mean()))

        policy.train()
        with replay.replaying(routes if replay_on else None):
            gate.rollout(step, ids, routes, mask, rollout_logprobs=rollout_lp, replayed=replay_on)
            output = policy(input_ids=ids, attention_mask=mask, use_cache=False)
        logits = output.logits
        new_lp = token_logprobs(logits, ids)[:, P - 1:]            # the completion tokens
        ratio = torch.exp(new_lp - rollout_lp[:, P:])
        surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - args.clip, 1 + args.clip) * advantages)
        loss = -surrogate.mean()
        if args.aux_coef > 0:                                       # the load-balancing loss of the update's routing
            loss = loss + args.aux_coef * output.aux_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()

        if step % args.every == 0 or step == args.steps:
            since = rewards[gates[-1]["step"]:]
            record = gate.run(step, loss=float(np.mean(since)), loss_key="reward")
            gates.append(record)
            print(f"[{run}] step {step:3d} reward {np.mean(since):.3f} gate {record['status']:8s} "
                  f"{record['stage']:9s} trend={record.get('loss_trend')}  ({time.perf_counter() - started:.0f} s)",
                  flush=True)
    gate.finish()
    return {"rewards": rewards, "gates": [{k: g.get(k) for k in ("step", "loss", "status", "stage", "loss_trend",
                                                              "objective_direction")} for g in gates],
            "seconds": time.perf_counter() - started, "run_dir": gate.out_dir}


# --- the comparison -------------------------------------------------------------------------------------------


def per_layer(lines: list[dict[str, Any]], field: str) -> dict[int, list[float]]:
    """Per routed layer (its model layer number), ``field`` of every recorded step (NaN where None)."""
    out: dict[int, list[float]] = {}
    for line in lines:
        for row in line["layers"]:
            value = row.get(field)
            out.setdefault(int(row["layer"]), []).append(np.nan if value is None else float(value))
    return out


def _near_tie(lines: list[dict[str, Any]], precision: str) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for line in lines:
        for row in line["layers"]:
            value = (row.get("near_tie") or {}).get(precision)
            out.setdefault(int(row["layer"]), []).append(np.nan if value is None else float(value))
    return out


def _f(x: float) -> str:
    """Four decimals; a small non-zero value (a k3) in scientific notation."""
    if x is None or not np.isfinite(x):
        return "-"
    return f"{x:.4f}" if x == 0 or abs(x) >= 1e-3 else f"{x:.1e}"


def _fls(values: list[float]) -> str:
    """first / last / mean over steps."""
    return f"{_f(values[0])} / {_f(values[-1])} / {_f(float(np.nanmean(values)))}"


def run_summary(run: str, result: dict[str, Any], lines: list[dict[str, Any]], window: int) -> dict[str, Any]:
    """The numbers the comparison prints for one run, read back from its ``rollout.jsonl``."""
    summaries = [summarize(line) for line in lines]
    logprobs = [line.get("logprobs") or {} for line in lines]
    rewards = result["rewards"]
    first = {str(k): v for k, v in sorted(
        {int(k): 0 for k in lines[0]["first_mismatch"]["by_layer"]}.items())}
    for line in lines:
        for k, v in line["first_mismatch"]["by_layer"].items():
            first[str(k)] += int(v)
    return {
        "run": run, "steps": len(lines), "rewards": rewards, "window": window,
        "reward_first_last": (rewards[0], rewards[-1]),
        "reward_window": (float(np.mean(rewards[:window])), float(np.mean(rewards[-window:]))),
        "mismatch": per_layer(lines, "mismatch"), "jaccard": per_layer(lines, "jaccard"),
        "near_tie_bf16": _near_tie(lines, "bf16"),
        "token_mismatch": [s.get("token_mismatch", np.nan) for s in summaries],
        "abs_diff": [lp.get("abs_diff_mean") or np.nan for lp in logprobs],
        "k3": [lp.get("k3") if lp.get("k3") is not None else np.nan for lp in logprobs],
        "fallback": sum(row["fallback"] for line in lines for row in line["layers"]),
        "tokens": sum(row["tokens"] for line in lines for row in line["layers"]),
        "first_mismatch": first, "gates": result["gates"], "seconds": result["seconds"], "run_dir": result["run_dir"],
        "alerts": {level: sum(a.get("level") == level for line in lines for a in line.get("alerts") or [])
                   for level in ("WARN", "INFO")},
    }


def compare_rows(summaries: list[dict[str, Any]]) -> list[list[str]]:
    """The side-by-side table: one row per figure, one column per run."""
    rows = [["steps", *[str(s["steps"]) for s in summaries]],
            ["mean reward, first / last step", *[f"{_f(a)} / {_f(b)}" for s in summaries
                                                 for a, b in [s["reward_first_last"]]]],
            [f"mean reward, first / last {summaries[0]['window']} steps", *[f"{_f(a)} / {_f(b)}" for s in summaries
                                                    for a, b in [s["reward_window"]]]]]
    layers = list(summaries[0]["mismatch"])
    for layer in layers:
        rows.append([f"mismatch layer {layer} (first / last / mean)", *[_fls(s["mismatch"][layer]) for s in summaries]])
    rows.append(["token_mismatch (first / last / mean)", *[_fls(s["token_mismatch"]) for s in summaries]])
    for layer in layers:
        rows.append([f"near_tie bf16 layer {layer} (mean)",
                     *[_f(float(np.nanmean(s["near_tie_bf16"][layer]))) for s in summaries]])
    rows.append(["logprob abs diff (first / last / mean)", *[_fls(s["abs_diff"]) for s in summaries]])
    rows.append(["logprob k3 (first / last / mean)", *[_fls(s["k3"]) for s in summaries]])
    rows.append(["first mismatch layer (positions, all steps)",
                 *[", ".join(f"{k}: {v}" for k, v in s["first_mismatch"].items()) for s in summaries]])
    rows.append(["fallback (positions, all steps and layers)", *[f"{s['fallback']} of {s['tokens']}" for s in summaries]])
    rows.append(["rollout alerts (raised WARN / cleared INFO)",
                 *[f"{s['alerts']['WARN']} / {s['alerts']['INFO']}" for s in summaries]])
    rows.append(["last gate (status, stage, objective trend)",
                 *[f"{g['status']}, {g['stage']}, {g['loss_trend']}" for s in summaries for g in [s["gates"][-1]]]])
    rows.append(["wall time (s)", *[f"{s['seconds']:.0f}" for s in summaries]])
    return rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def plain(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in [header, *rows])


def figure(summaries: list[dict[str, Any]], path: Path) -> None:
    """Mismatch per routed layer over steps, one panel per run, the same y axis."""
    from atlas_tracking.viz.figures import png_bytes, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, len(summaries), figsize=(11, 3.8), sharey=True)
    for ax, s in zip(np.atleast_1d(axes), summaries):
        for layer, values in s["mismatch"].items():
            ax.plot(range(1, len(values) + 1), values, "o-", ms=2.5, lw=1, label=f"layer {layer}")
        ax.set_title(f"{s['run']}: mismatch per routed layer")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("mismatch (share of positions)")
    np.atleast_1d(axes)[0].legend(fontsize=8)
    path.write_bytes(png_bytes(fig))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10, help="a gate every this many steps")
    parser.add_argument("--out", default="out/grpo_replay")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO's group)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--aux-coef", type=float, default=0.1, help="the load-balancing loss's weight in the update "
                        "(0: none; the routing then collapses onto a few experts within tens of steps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the matrices are tiny: one is "
                        "as fast as two, and many threads on a shared CPU are much slower)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prose = encode(prose_text())
    canary = Canary.from_token_ids(prose[int(0.9 * len(prose)):], window=64, n_windows=16, seed=0)
    started = time.perf_counter()
    summaries = []
    for run in RUNS:
        result = train(run, args, prose, canary)
        lines = read_rollout(result["run_dir"])     # <out>/<run>/atlas; atlas-2, ... beside an earlier run's record
        summaries.append(run_summary(run, result, lines, window=min(5, args.steps)))
    header = ["", *RUNS]
    rows = compare_rows(summaries)
    print()
    print(plain(header, rows))
    command = "python examples/grpo_replay.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / "compare.md").write_text(
        f"# GRPO with and without routing replay\n\n`{command.strip()}` ({args.steps} steps, {args.prompts} prompts x "
        f"{args.group} completions of {args.new_tokens} bytes, {args.experts} experts top-{args.top_k}, lr {args.lr}, "
        f"load-balancing loss x {args.aux_coef}, seed {args.seed})\n\n{markdown(header, rows)}\n")
    figure(summaries, out / "rollout_mismatch.png")
    (out / "summary.json").write_text(json.dumps(
        {s["run"]: {"rewards": s["rewards"], "reward_window": s["reward_window"], "tokens": s["tokens"],
                    "mismatch": {str(k): v for k, v in s["mismatch"].items()}, "token_mismatch": s["token_mismatch"],
                    "fallback": s["fallback"], "gates": s["gates"], "seconds": s["seconds"],
                    "run_dir": str(s["run_dir"])} for s in summaries},
        indent=1, default=float))
    print(f"\nwrote {out / 'compare.md'} and {out / 'rollout_mismatch.png'}; the runs' records: "
          f"{', '.join(str(s['run_dir']) for s in summaries)} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
