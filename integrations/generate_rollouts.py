"""Rollouts from transformers' ``generate``: the routes the model's routers chose while it generated, handed to
``AtlasGate.rollout`` (docs/rollout.md#grpotrainer).

A trainer that samples its rollouts with the policy's own ``generate`` (TRL's ``GenerateRollouts`` default path: the
same module, under the same autocast) routes every token once while generating: the prompt in the prefill call,
then each new token in its own decoding call (with the key-value cache), or the whole sequence again at every
call without it. :class:`GenerationRoutes` keeps those routes per position, and :func:`generated_rollouts` wraps a
model's ``generate`` so that every call made in training is handed to the gate with them: the agreement then says
how far the update's full forward on the generated tokens routes from the incremental forward that sampled them.
The last generated token is never run through the model while generating; its position is compared by no one
(``-1``, masked), as vLLM and SGLang leave it out.

Example:
    >>> import torch
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> from atlas_tracking.adapters import find_routed_layers
    >>> _ = torch.manual_seed(0)
    >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ...     head_dim=8, num_experts=8, num_experts_per_tok=2, eos_token_id=None, pad_token_id=0)).eval()
    >>> routes = GenerationRoutes(find_routed_layers(model))
    >>> out = routes.generate(model, input_ids=torch.randint(1, 64, (2, 5)), max_new_tokens=4, do_sample=False)
    >>> routes.routed_experts(out).shape, int((routes.routed_experts(out)[:, -1] == -1).all())
    (torch.Size([2, 9, 2, 2]), 1)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from atlas_tracking.adapters.base import RoutedLayer
from atlas_tracking.engine.rollout import RouterReads


class GenerationRoutes:
    """The active sets each routed layer chose, per position, during one ``generate`` call."""

    def __init__(self, layers: list[RoutedLayer]):
        self.layers = layers
        self.calls: list[list[torch.Tensor]] = []

    def generate(self, model: nn.Module, *args: Any, generate: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        """``model.generate(*args, **kwargs)`` (or ``generate``) with the routers read; returns its output."""
        reads = RouterReads(self.layers, lambda i, routing, start: routing.active)
        output = reads.run(lambda: (generate or model.generate)(*args, **kwargs), None)
        self.calls = reads.parts
        return output

    def routed_experts(self, output: Any) -> torch.Tensor:
        """``[batch, seq, routed layers, k]`` int64 for the generated ``sequences`` (``output`` or its
        ``.sequences``): position ``t`` holds the experts chosen when token ``t`` was run through the model; the last
        position, never run, holds ``-1``."""
        sequences = getattr(output, "sequences", output)
        batch, seq = sequences.shape
        out = []
        for calls in self.calls:
            k = calls[0].shape[-1]
            rows = torch.full((batch, seq, k), -1, dtype=torch.int64)
            covered = 0
            for active in calls:
                m = active.shape[0] // batch
                start = covered if (covered == 0 or m == 1) else 0  # a call without the cache runs every position
                rows[:, start:start + m] = active.view(batch, m, k).cpu()
                covered = max(covered, start + m)
            out.append(rows)
        return torch.stack(out, dim=2)


def generated_mask(output: Any, prompt_mask: torch.Tensor | None, eos: list[int]) -> torch.Tensor:
    """``[batch, seq]``: 1 where a position is compared: the prompt's own positions (its attention mask), the
    generated tokens up to and including the first end-of-sequence token; never the last position (no route).

    >>> generated_mask(torch.tensor([[5, 6, 7, 2, 0, 0]]), torch.tensor([[1, 1]]), [2]).tolist()
    [[1, 1, 1, 1, 0, 0]]
    """
    sequences = getattr(output, "sequences", output)
    batch, seq = sequences.shape
    prompt = prompt_mask.shape[1] if prompt_mask is not None else 0
    mask = torch.ones(batch, seq, dtype=torch.int64, device=sequences.device)
    if prompt_mask is not None:
        mask[:, :prompt] = prompt_mask.to(mask.device, torch.int64)
    completion = sequences[:, prompt:]
    ended = torch.zeros(batch, completion.shape[1], dtype=torch.bool, device=sequences.device)
    if eos and completion.shape[1]:
        hit = torch.isin(completion, torch.tensor(eos, device=sequences.device))
        ended[:, 1:] = hit.cumsum(1)[:, :-1] > 0  # after the first end-of-sequence token
    mask[:, prompt:] = torch.where(ended, 0, mask[:, prompt:])
    mask[:, -1] = 0
    return mask


@contextlib.contextmanager
def generated_rollouts(model: nn.Module, layers: list[RoutedLayer], hand: Callable[..., Any],
                       eos: list[int]) -> Iterator[None]:
    """Inside the block, every ``model.generate`` call made while the model is in training mode (a trainer's
    rollouts; an evaluation's generation is left alone) reads the routers and then calls
    ``hand(sequences, routed_experts, attention_mask)``; the model's own ``generate`` is back afterwards."""
    original = model.generate
    routes = GenerationRoutes(layers)

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        if not model.training:
            return original(*args, **kwargs)
        output = routes.generate(model, *args, generate=original, **kwargs)
        sequences = getattr(output, "sequences", output)
        prompt_mask = kwargs.get("attention_mask")
        hand(sequences, routes.routed_experts(output), generated_mask(output, prompt_mask, eos))
        return output

    own = vars(model).get("generate")
    model.generate = generate
    try:
        yield
    finally:
        if own is None:
            del model.generate  # the class's method is the model's own again
        else:
            model.generate = own


def trainer_rollouts(args: Any, state: Any, model: nn.Module, gate: Any,
                     warn: Callable[[str], None]) -> contextlib.AbstractContextManager:
    """For a transformers Trainer whose rollouts come from the policy's own ``generate`` (TRL's GRPOTrainer and
    RLOOTrainer without vLLM): every training-mode generation is handed to ``gate.rollout`` at the optimizer step it
    serves (``state.global_step + 1``). Nothing when the gate measures no rollouts; a warning when TRL generates with
    vLLM, whose generation path does not return the routed experts (hand them over from your own loop then)."""
    if gate.rollouts is None or not callable(getattr(model, "generate", None)):
        return contextlib.nullcontext()
    if getattr(args, "use_vllm", False):
        warn("atlas: the trainer generates its rollouts with vLLM, whose TRL generation path does not return the "
             "routed experts: no rollout agreement is measured (a loop that has them calls gate.rollout; "
             "docs/rollout.md#grpotrainer)")
        return contextlib.nullcontext()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    def hand(sequences: torch.Tensor, routed: torch.Tensor, mask: torch.Tensor) -> None:
        step = int(state.global_step) + 1
        gate.rollout(step, sequences, routed, mask, log_step=step)

    return generated_rollouts(model, gate.layers, hand, eos)
