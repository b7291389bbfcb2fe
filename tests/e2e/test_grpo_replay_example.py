"""``examples/grpo_replay.py`` end to end, shortened: GRPO on a small MoE with bf16 rollouts and fp32 updates, once
without and once with routing replay; each run's ``rollout.jsonl`` holds one line per step, the run without replay
measured the engines' natural mismatch and the run with it none, the reward rose, and the gates read it maximised."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from atlas_tracking.artifacts.history import read_history
from atlas_tracking.artifacts.rollout_record import read_rollout

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY = 12, 6


@pytest.mark.slow
def test_grpo_replay_example_runs_both_runs_and_compares_them(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "grpo_replay.py"), "--steps", str(STEPS), "--every",
                           str(EVERY), "--prompts", "4", "--group", "4", "--new-tokens", "12", "--lr", "2e-2",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {run: read_rollout(out / run / "atlas") for run in ("no_replay", "replay")}
    for run, replayed in (("no_replay", False), ("replay", True)):
        assert [line["step"] for line in lines[run]] == list(range(1, STEPS + 1))
        assert {line["replayed"] for line in lines[run]} == {replayed}
        assert all(line["tokens"] == 16 * (16 + 12) and len(line["layers"]) == 4 for line in lines[run])
    mismatched = {run: [row["mismatched"] for line in lines[run] for row in line["layers"]] for run in lines}
    assert sum(mismatched["no_replay"]) > 0, "the bf16 engine routes some position apart from the fp32 policy"
    assert set(mismatched["replay"]) == {0}, "the update replays the rollout's routes: nothing to disagree on"
    assert all(row["mismatch"] == 0.0 and row["jaccard"] == 1.0 for line in lines["replay"] for row in line["layers"])
    assert all(line["first_mismatch"]["none"] == line["tokens"] for line in lines["replay"])

    summary = json.loads((out / "summary.json").read_text())
    first, last = summary["no_replay"]["reward_window"]
    assert last > first + 0.05, f"the reward did not rise without replay: {summary['no_replay']['rewards']}"
    assert summary["no_replay"]["rewards"][0] == summary["replay"]["rewards"][0]      # same weights, same samples
    for run in ("no_replay", "replay"):
        assert summary[run]["mismatch"]["0"] == [line["layers"][0]["mismatch"] for line in lines[run]]
        gates = read_history(out / run / "atlas")
        assert [g["step"] for g in gates] == [0, EVERY, STEPS] and gates[0]["status"] == "BASELINE"
        assert {(g["loss_key"], g["objective_direction"]) for g in gates} == {("reward", "maximize")}
        assert gates[-1]["loss"] == pytest.approx(sum(summary[run]["rewards"][EVERY:]) / (STEPS - EVERY))

    compare = (out / "compare.md").read_text()
    assert "| no_replay | replay |" in compare and "mismatch layer 3" in compare and "near_tie bf16" in compare
    assert (out / "rollout_mismatch.png").stat().st_size > 5000
    assert "mean reward, first / last step" in proc.stdout and "token_mismatch" in proc.stdout


def test_the_examples_replay_hook_is_the_routers_own_choice_when_given_it(script):
    """Replaying the policy's own routes changes nothing (the recomputed weights are the router's, bit for bit);
    replaying other experts sends the tokens there with the router's own probabilities, gradient included; a route
    that is not k distinct experts keeps the router's choice and is counted."""
    import torch

    from atlas_tracking.engine.rollout import trainer_routes

    example = script("examples/grpo_replay.py")
    policy = example.build_policy(seed=0, experts=8, top_k=2)
    replay = example.RouteReplay(policy)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    own = trainer_routes(policy, ids)
    with torch.no_grad():
        plain = policy(input_ids=ids).logits
        with replay.replaying(own):
            same = policy(input_ids=ids).logits
    assert torch.equal(plain, same) and replay.fallback == 0

    other = (own + 1) % 8                                        # every token to other experts (still distinct)
    other[0, 0, 0] = torch.tensor([-1, 3])                       # no route in the first layer: the router's choice
    with replay.replaying(other):
        routed = trainer_routes(policy, ids)
        out = policy(input_ids=ids).logits
    assert torch.equal(routed[0, 0, 0], own[0, 0, 0]) and torch.equal(routed[0, 0, 1:], other[0, 0, 1:])
    assert torch.equal(routed[:, 1:], other[:, 1:]) and torch.equal(routed[1], other[1])
    assert replay.fallback == 2                                  # one position, read in two forwards
    out.sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in replay.routers)
    assert not torch.allclose(out.detach(), plain)
