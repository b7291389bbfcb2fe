"""Rollouts from transformers' ``generate``: the routes read while the model generates, assembled per position,
against the test's own hooks on the experts' calls; the wrapper hands training-mode generations to the gate."""

from __future__ import annotations

import pytest
import torch
from atlas_tracking.integrations.generate_rollouts import GenerationRoutes, generated_mask, generated_rollouts

from atlas_tracking import AtlasGate, rollout_agreement
from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.tiny import QUIET, random_canary

PROMPT, NEW = 6, 5


def model_and_prompt(family: str = "qwen3_moe"):
    model = family_model(family, seed=0, eos_token_id=None).eval()
    ids = torch.randint(1, 64, (3, PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0                                                   # a left-padded prompt
    return model, ids, mask


def own_generation_routes(model, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences and, per position, the experts each block computed with (the test's own hooks on the experts'
    calls), assembled by hand: the first call holds every prompt position, each later call one new position, or,
    without the cache, every position so far (its last is the new one)."""
    blocks = [layer.block for layer in find_routed_layers(model)]
    seen = [[] for _ in blocks]
    handles = [b.experts.register_forward_pre_hook(lambda m, args, i=i: seen[i].append(args[1].clone()))
               for i, b in enumerate(blocks)]
    with torch.no_grad():
        out = model.generate(**kwargs)
    for h in handles:
        h.remove()
    batch, seq = out.shape
    layers = []
    for calls in seen:
        rows = torch.full((batch, seq, calls[0].shape[-1]), -1, dtype=torch.int64)
        rows[:, :PROMPT] = calls[0].view(batch, PROMPT, -1)
        for j, call in enumerate(calls[1:]):
            rows[:, PROMPT + j] = call.view(batch, -1, call.shape[-1])[:, -1]
        layers.append(rows)
    return out, torch.stack(layers, dim=2)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_routes_read_while_generating_equal_the_tests_own(family, use_cache):
    model, ids, mask = model_and_prompt(family)
    args = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, use_cache=use_cache,
                pad_token_id=0)
    out, want = own_generation_routes(model, **args)
    routes = GenerationRoutes(find_routed_layers(model))
    again = routes.generate(model, **args)
    assert torch.equal(again, out)
    got = routes.routed_experts(again)
    assert got.shape == (3, PROMPT + NEW, len(routes.layers), 2)
    assert torch.equal(got, want) and (got[:, -1] == -1).all() and (got[:, :-1] >= 0).all()


def test_the_mask_keeps_the_prompt_and_the_completion_to_its_first_end_token():
    seq = torch.tensor([[0, 3, 4, 9, 2, 7, 7], [3, 3, 4, 9, 9, 9, 9]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert generated_mask(seq, prompt_mask, [2]).tolist() == [[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0]]


def test_training_mode_generations_reach_the_gate_uncounted_and_evaluation_ones_do_not(tmp_path):
    model, ids, mask = model_and_prompt()
    gate = AtlasGate(model, random_canary(), {**QUIET, "telemetry": {"every_n_steps": 1}}, out_dir=str(tmp_path))
    handed, given = [], []

    def hand(sequences, routed, attention_mask):
        given.append((sequences, routed, attention_mask))
        handed.append(gate.rollout(len(handed) + 1, sequences, routed, attention_mask))

    with generated_rollouts(model, gate.layers, hand, eos=[]):
        model.eval().generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        assert handed == []
        model.train().generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, pad_token_id=0)
    assert "generate" not in vars(model)                               # the model's own generate is back
    assert not gate.telemetry.counter.pending()                      # generating is no training forward
    line = handed[0]
    expected_tokens = int(mask.sum()) + 3 * (NEW - 1)                 # the last position has no route
    assert [row["tokens"] for row in line["layers"]] == [expected_tokens] * 2
    sequences, routed, attention_mask = given[0]
    want = rollout_agreement(model, sequences, routed, attention_mask)
    assert [row["mismatched"] for row in line["layers"]] == [row["mismatched"] for row in want["layers"]]
