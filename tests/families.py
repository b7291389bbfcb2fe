"""Tiny random configs of the six transformers MoE families (the architecture code is transformers' own)."""

from __future__ import annotations

import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


def family_config(name: str):
    import transformers as tf

    common = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, max_position_embeddings=128)
    if name == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=48, num_hidden_layers=2, num_key_value_heads=2,
                                num_local_experts=6, num_experts_per_tok=2)
    if name == "qwen2_moe":
        return tf.Qwen2MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24,
                                 shared_expert_intermediate_size=40, num_hidden_layers=2, num_key_value_heads=2,
                                 num_experts=6, num_experts_per_tok=2)
    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
                                 num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, head_dim=8)
    if name == "olmoe":
        return tf.OlmoeConfig(**common, intermediate_size=24, num_hidden_layers=2, num_key_value_heads=2,
                              num_experts=6, num_experts_per_tok=2)
    if name == "deepseek_v3":
        return tf.DeepseekV3Config(**common, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=3,
                                   num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                   topk_group=2, first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=16,
                                   kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                   routed_scaling_factor=2.5, norm_topk_prob=True)
    if name == "gpt_oss":
        return tf.GptOssConfig(**common, intermediate_size=24, num_hidden_layers=2, num_key_value_heads=2,
                               num_local_experts=6, num_experts_per_tok=2, head_dim=8)
    raise KeyError(name)


def family_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(name)).to(dtype).eval()
    with torch.no_grad():  # random routers and biases with spread, so routing is not degenerate
        for module in model.modules():
            cls = type(module).__name__
            if cls.endswith("TopkRouter") or cls.endswith("TopKRouter"):
                module.weight.normal_(0, 0.5)
                if hasattr(module, "bias") and isinstance(module.bias, torch.nn.Parameter):
                    module.bias.normal_(0, 0.5)
                if hasattr(module, "e_score_correction_bias"):
                    module.e_score_correction_bias.normal_(0, 0.1)
    return model


def capture_layers(model, ids):
    """One forward with hooks of our own on every routed layer's norm, router and block: the layers and,
    per layer name, what each hook saw (``x``, ``g``, ``router``, ``out``)."""
    from atlas_tracking.adapters import find_routed_layers

    layers = find_routed_layers(model)
    seen = {lay.name: {} for lay in layers}
    handles = []
    for lay in layers:
        d = seen[lay.name]
        handles.append(lay.norm.register_forward_hook(lambda m, i, o, d=d: d.update(x=i[0], g=o)))
        handles.append(lay.router.register_forward_hook(lambda m, i, o, d=d: d.update(router=o)))
        handles.append(lay.block.register_forward_hook(lambda m, i, o, d=d: d.update(out=o[0] if isinstance(o, tuple) else o)))
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    return layers, seen
