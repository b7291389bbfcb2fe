"""torchtitan 0.2 on a CPU: the one stand-in that ``examples/torchtitan_loop.py`` and ``tests/integrations/test_torchtitan.py`` use,
and the tiny models they build.

Stand-in (the arithmetic is unchanged):

* ``cpu_histc_for_expert_counts`` lets ``torch.histc`` take the int64 expert indices torchtitan's
  ``TokenChoiceTopKRouter`` and ``TokenReorderer`` count with (``histc(indices, bins=E, min=0, max=E)``):
  only the CUDA kernel takes integers. Inside the context, integer CPU input is counted as float (indices
  below 2**24 are exact in fp32) and the counts come back in the input's integer dtype, as on CUDA.

Settings (no code replaced): ``use_grouped_mm=False`` (the experts' for-loop path; ``torch._grouped_mm``
needs 16-byte-aligned groups); torchtitan 0.2.2's DeepSeek-V3 block reads ``model_args.moe_impl``, which
its args dataclass does not define, so it is set to ``"standard"`` as its config loader would; weights are
initialised with the models' own ``init_weights`` under ``no_grad``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def cpu_histc_for_expert_counts() -> Iterator[None]:
    """``torch.histc`` on integer CPU tensors, counted in fp32 and returned in the input's dtype."""
    real = torch.histc

    def histc(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0, *, out=None) -> torch.Tensor:
        if input.is_floating_point() or input.device.type != "cpu":
            return real(input, bins=bins, min=min, max=max, out=out)
        return real(input.float(), bins=bins, min=min, max=max).to(input.dtype)

    torch.histc = histc
    try:
        yield
    finally:
        torch.histc = real


def _init(model):
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def deepseek_v3(seed: int = 0, vocab: int = 64, dim: int = 32):
    """torchtitan's DeepSeek-V3: sigmoid + expert bias in 2 of 4 groups, normalised and scaled, a shared expert,
    a dense first layer."""
    from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
    from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model
    from torchtitan.models.moe import MoEArgs

    torch.manual_seed(seed)
    moe = MoEArgs(num_experts=8, num_shared_experts=1, score_func="sigmoid", route_norm=True, route_scale=2.5,
                  score_before_experts=False, top_k=2, num_expert_groups=4, num_limited_groups=2, use_grouped_mm=False)
    args = DeepSeekV3ModelArgs(vocab_size=vocab, dim=dim, inter_dim=2 * dim, moe_inter_dim=dim, n_layers=3,
                               n_dense_layers=1, n_heads=4, moe_args=moe, q_lora_rank=0, kv_lora_rank=16,
                               qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, max_seq_len=128,
                               original_seq_len=128)
    args.moe_impl = "standard"
    return _init(DeepSeekV3Model(args))


def qwen3(seed: int = 0, vocab: int = 64, dim: int = 32):
    """torchtitan's Qwen3-MoE: softmax top-2, normalised, no shared expert, no expert bias."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Qwen3Model

    torch.manual_seed(seed)
    moe = MoEArgs(num_experts=8, num_shared_experts=0, score_func="softmax", route_norm=True,
                  score_before_experts=False, top_k=2, use_grouped_mm=False, load_balance_coeff=None)
    args = Qwen3ModelArgs(dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab, head_dim=8,
                          hidden_dim=2 * dim, max_seq_len=128, moe_enabled=True, moe_inter_dim=dim, moe_args=moe)
    return _init(Qwen3Model(args))


def llama4(seed: int = 0, vocab: int = 64, dim: int = 32):
    """torchtitan's Llama 4 MoE (top-2 here; the released models route top-1): sigmoid scores scaling the expert inputs
    before the experts, a shared expert."""
    from torchtitan.models.llama4.model.args import TransformerModelArgs
    from torchtitan.models.llama4.model.model import Transformer
    from torchtitan.models.moe import MoEArgs

    torch.manual_seed(seed)
    moe = MoEArgs(num_experts=8, num_shared_experts=1, top_k=2, use_grouped_mm=False)
    args = TransformerModelArgs(dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab, max_seq_len=128,
                                multiple_of=16, interleave_moe_layer_step=1, moe_args=moe)
    return _init(Transformer(args))


MODELS = {"deepseek_v3": deepseek_v3, "qwen3": qwen3, "llama4": llama4}
