"""``rollout_agreement`` on real transformers families: a bf16 copy of the model stands in for the rollout engine;
its routing, and the fp32 trainer's, are captured by the test's own hooks on the experts' calls (what the block
actually computed with) and compared by plain loops; the counts must be equal, exactly."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from atlas_tracking import RolloutInputError, rollout_agreement
from atlas_tracking.adapters import find_routed_layers
from atlas_tracking.engine.rollout import decoder_layers, trainer_routes
from atlas_tracking.testing.families import family_model

FAMILIES = {
    "qwen3_moe": {},                                 # softmax
    "mixtral": {},
    "gpt_oss": {},                                   # top-k, then softmax
    "deepseek_v3": {},                               # sigmoid with bias, group-limited; a dense first layer
    "longcat_flash": {},                             # zero-computation experts
    "llama4_text": {"num_experts_per_tok": 1},       # top-1 (sigmoid)
}
BATCH, SEQ = 8, 32


def own_routes(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    """``[batch, seq, routed layers, k]``: the expert ids each MoE block computed with, read by hooks of the test's
    own (the ids handed to the experts module; Llama-4's router scores, zero outside its top-k)."""
    blocks = [layer.block for layer in find_routed_layers(model)]
    seen: list[list[torch.Tensor]] = [[] for _ in blocks]
    handles = []
    for i, block in enumerate(blocks):
        if type(block).__name__ == "Llama4TextMoe":
            def grab(module, args, output, i=i):
                scores = output[0].float()
                seen[i].append(torch.stack([row.nonzero().view(-1) for row in scores]))
            handles.append(block.router.register_forward_hook(grab))
        else:
            def grab(module, args, i=i):
                seen[i].append(args[1].detach().clone())
            handles.append(block.experts.register_forward_pre_hook(grab))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    for handle in handles:
        handle.remove()
    return torch.stack([torch.cat(s).view(BATCH, SEQ, -1) for s in seen], dim=2).numpy()


def loops(trainer: np.ndarray, rollout: np.ndarray, mask: np.ndarray) -> tuple[list[dict], dict]:
    """Per routed layer: mismatched positions, routes moved, mean Jaccard; the first differing layer per token."""
    layers = []
    for j in range(trainer.shape[2]):
        row = {"tokens": 0, "mismatched": 0, "routes_moved": 0, "jaccard": 0.0}
        for b in range(BATCH):
            for s in range(SEQ):
                if not mask[b, s]:
                    continue
                a, c = set(trainer[b, s, j].tolist()), set(rollout[b, s, j].tolist())
                row["tokens"] += 1
                row["mismatched"] += a != c
                row["routes_moved"] += len(a) - len(a & c)
                row["jaccard"] += len(a & c) / len(a | c)
        row["jaccard"] /= row["tokens"]
        layers.append(row)
    first: dict[int, int] = {}
    for b in range(BATCH):
        for s in range(SEQ):
            if mask[b, s]:
                hit = [j for j in range(trainer.shape[2])
                       if set(trainer[b, s, j].tolist()) != set(rollout[b, s, j].tolist())]
                key = hit[0] if hit else -1
                first[key] = first.get(key, 0) + 1
    return layers, first


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[:3, :5] = 0                                  # left padding
    return ids, mask


@pytest.mark.parametrize("family", list(FAMILIES))
def test_agreement_counts_equal_the_tests_own_against_a_bf16_rollout(family):
    model = family_model(family, seed=0, **FAMILIES[family]).eval()
    rollout_model = copy.deepcopy(model).to(torch.bfloat16)
    ids, mask = batch()
    trainer = own_routes(model, ids, mask)
    rollout = own_routes(rollout_model, ids, mask)
    result = rollout_agreement(model, ids, rollout, attention_mask=mask)
    want, first = loops(trainer, rollout, mask.numpy())
    layers = find_routed_layers(model)
    assert [row["layer"] for row in result["layers"]] == [layer.index for layer in layers]
    for got, ref in zip(result["layers"], want):
        assert got["tokens"] == got["compared"] == ref["tokens"] == int(mask.sum())
        assert (got["mismatched"], got["routes_moved"], got["fallback"]) == (ref["mismatched"], ref["routes_moved"], 0)
        assert got["jaccard"] == pytest.approx(ref["jaccard"], abs=1e-6)
    by_layer = {str(layer.index): first.get(j, 0) for j, layer in enumerate(layers)}
    assert result["first_mismatch"] == {"tokens": int(mask.sum()), "by_layer": by_layer, "none": first.get(-1, 0)}
    assert result["layer_axis"] == "routed" and result["replayed"] is False
    assert np.array_equal(trainer_routes(model, ids, mask).numpy(), trainer)   # the engine reads what the block ran


def test_the_families_mismatch_somewhere_so_the_counts_are_not_all_zero():
    total = 0
    for family in ("qwen3_moe", "mixtral", "deepseek_v3"):
        model = family_model(family, seed=0).eval()
        ids, mask = batch()
        rollout = own_routes(copy.deepcopy(model).to(torch.bfloat16), ids, mask)
        total += sum(row["mismatched"] for row in rollout_agreement(model, ids, rollout, mask)["layers"])
    assert total > 0


def test_vllms_layout_with_a_row_per_decoder_layer_reads_the_routed_ones():
    model = family_model("deepseek_v3", seed=0).eval()             # layer 0 is dense: its rows are ignored
    ids, mask = batch()
    routed = own_routes(copy.deepcopy(model).to(torch.bfloat16), ids, mask)
    layers = find_routed_layers(model)
    full = np.zeros((BATCH, SEQ, decoder_layers(model, layers), routed.shape[3]), dtype=np.uint8)  # vLLM: uint8
    for j, layer in enumerate(layers):
        full[:, :, layer.index] = routed[:, :, j]
    by_decoder = rollout_agreement(model, ids, full, mask)
    by_routed = rollout_agreement(model, ids, torch.from_numpy(routed), mask)
    assert by_decoder["layer_axis"] == "decoder" and [r["layer"] for r in by_decoder["layers"]] == [1, 2]
    assert by_decoder["layers"] == by_routed["layers"]


def test_a_route_that_cannot_be_replayed_is_counted_as_fallback_never_dropped():
    model = family_model("qwen3_moe", seed=0).eval()
    ids, mask = batch()
    routes = own_routes(model, ids, mask).copy()
    routes[0, 10, 0] = -1                              # no route recorded (the sentinel replay engines use)
    routes[1, 10, 1, 1] = routes[1, 10, 1, 0]          # a repeated expert: not a set
    routes[2, 2, 0] = -1                               # a padded position: not counted at all
    result = rollout_agreement(model, ids, routes, mask, replayed=True)
    first, second = result["layers"]
    assert (first["tokens"], first["fallback"], first["compared"]) == (int(mask.sum()), 1, int(mask.sum()) - 1)
    assert (second["fallback"], second["mismatched"]) == (1, 0)
    assert result["replayed"] is True and result["first_mismatch"]["none"] == int(mask.sum())


def test_log_probabilities_of_both_engines_read_as_abs_difference_and_k3():
    model = family_model("qwen3_moe", seed=0).eval()
    rollout_model = copy.deepcopy(model).to(torch.bfloat16)
    ids, mask = batch()
    with torch.no_grad():
        theirs = torch.log_softmax(rollout_model(input_ids=ids, attention_mask=mask).logits.float(), -1)
        ours = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    lp_r = torch.full((BATCH, SEQ), float("nan"))
    lp_r[:, 1:] = theirs[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2)
    lp_t = ours[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2).numpy()
    result = rollout_agreement(model, ids, own_routes(rollout_model, ids, mask), mask, rollout_logprobs=lp_r)
    keep = mask[:, 1:].bool().numpy()
    r = (lp_t - lp_r[:, 1:].numpy())[keep]
    assert result["logprobs"]["tokens"] == keep.sum()
    assert result["logprobs"]["abs_diff_mean"] == pytest.approx(np.abs(r).mean(), abs=1e-5)
    assert result["logprobs"]["k3"] == pytest.approx(np.mean(np.expm1(r) - r), abs=1e-6)
    assert result["logprobs"]["abs_diff_mean"] > 0


@pytest.mark.parametrize("change, error", [
    (lambda r, ids, m: (r.astype(np.float32), ids, m), "integer expert ids"),
    (lambda r, ids, m: (r[:, :, :, 0], ids, m), r"\[batch, seq, routed_layers, k\]"),
    (lambda r, ids, m: (r[:4], ids, m), r"\[batch, seq\] = \[4, 32\], input_ids \[8, 32\]"),
    (lambda r, ids, m: (r[:, :31], ids, m), r"\[batch, seq\] = \[8, 31\]"),
    (lambda r, ids, m: (np.concatenate([r, r[..., :1]], axis=3), ids, m), "k = 3; routed layer 0"),
    (lambda r, ids, m: (r[:, :, :1], ids, m), "has 1 layers; the model has 2 routed layers"),
    (lambda r, ids, m: (np.where(np.arange(2)[None, None, :, None] == 1, 6, r), ids, m),
     r"= 6 is not an expert of routed layer 1 .*experts 0\.\.5"),
    (lambda r, ids, m: (np.where(r == r.max(), -2, r), ids, m), "= -2 is not an expert"),
    (lambda r, ids, m: (r, ids, m[:, :16]), r"attention_mask has shape \[8, 16\]"),
])
def test_bad_input_is_an_error_that_names_what_differs(change, error):
    model = family_model("qwen3_moe", seed=0).eval()
    ids, mask = batch()
    routes = own_routes(model, ids, mask)
    bad_routes, bad_ids, bad_mask = change(routes, ids, mask)
    with pytest.raises(RolloutInputError, match=error):
        rollout_agreement(model, bad_ids, bad_routes, bad_mask)
