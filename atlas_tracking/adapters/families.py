"""The transformers MoE family table: one row per family, as data.

Each row names the MoE block class, the router semantics (``adapters/routers.py``), the pre-norm and
its gain convention, the shared-expert wiring and any scaling outside the router; :class:`HFLayer`
reads every row. ``REFUSED`` lists the causal-LM MoE families whose routed block cannot be read
exactly, with the reason (the registry raises it when such a block is found); ``NOT_MOE`` the model
types whose modeling code mentions experts but that hold no routed block. A test walks the installed
transformers' model registry against these three tables, so an upgrade cannot drop coverage silently.
"""

from __future__ import annotations

from atlas_tracking.adapters.hf import (
    Family,
    FlatOutputLayer,
    InputScaledLayer,
    JetMoeLayer,
    LatentLayer,
    RouterGatedSharedLayer,
    Shared,
    TwoSlotLayer,
    register_rows,
)
from atlas_tracking.adapters.routers import (
    BiasedScores,
    GroupLimit,
    TopLogits,
    block_read,
    jetmoe_read,
    llama4_read,
)

SOFTMAX = TopLogits()
TOPK_SOFTMAX = TopLogits(kind="topk_softmax")
DSV3 = BiasedScores(groups=GroupLimit(), kind="sigmoid+bias, group-limited")
"""DeepSeek-V3: sigmoid + correction bias ranked inside the best ``topk_group`` of ``n_group`` groups."""
BLOCK_BIAS = BiasedScores(bias="block.e_score_correction_bias", kind="sigmoid+bias")
SHARED = Shared("shared_experts")
GATED_SHARED = Shared("shared_expert", gate="shared_expert_gate")


def _routed_scaling(block) -> float:
    return float(block.routed_scaling_factor)


def _norm_class(norm) -> str:
    """Cohere2-MoE's config picks its norm class: an RMSNorm when ``rms_norm_eps`` is set, else a mean-centred
    LayerNorm without a bias."""
    return "rms" if type(norm).__name__.endswith("RMSNorm") else "layernorm"


def _shared_average(block) -> float:
    """Cohere2-MoE's ``"average"`` combination halves the sum of the routed and the shared experts."""
    return 0.5 if block.num_shared_experts > 0 and block.shared_expert_combination_strategy == "average" else 1.0


def _deepseek_v3(name: str, block: str, **kw) -> Family:
    """DeepSeek-V3's block under another name (one line per family)."""
    return Family(name, (block,), DSV3, shared=kw.pop("shared", SHARED), **kw)


def _qwen3_next(name: str, block: str, **kw) -> Family:
    """Qwen2-MoE's block (sigmoid-gated shared expert) behind a zero-centred ``(1 + w)`` norm gain."""
    return Family(name, (block,), SOFTMAX, gain="1+w", shared=GATED_SHARED, **kw)


def _granite(name: str, block: str) -> Family:
    """IBM Granite MoE: top-k logits then softmax, router attribute ``router``."""
    return Family(name, (block,), TOPK_SOFTMAX, router_attr="router")


FAMILIES: tuple[Family, ...] = (
    Family("mixtral", ("MixtralSparseMoeBlock",), SOFTMAX),
    Family("qwen2_moe", ("Qwen2MoeSparseMoeBlock",), SOFTMAX, shared=GATED_SHARED),
    Family("qwen3_moe", ("Qwen3MoeSparseMoeBlock",), SOFTMAX),
    Family("olmoe", ("OlmoeSparseMoeBlock",), SOFTMAX),
    Family("minimax", ("MiniMaxSparseMoeBlock",), SOFTMAX),
    Family("mellum", ("MellumSparseMoeBlock",), SOFTMAX),
    Family("hunyuan_v1_moe", ("HunYuanMoEV1Moe",), SOFTMAX, shared=Shared("shared_mlp")),
    Family("jamba", ("JambaSparseMoeBlock",), SOFTMAX, router_attr="router", norm="pre_ff_layernorm"),
    Family("gpt_oss", ("GptOssMLP",), TOPK_SOFTMAX, router_attr="router"),
    Family("aria_text", ("AriaTextMoELayer",), TOPK_SOFTMAX, router_attr="router", shared=SHARED),
    _granite("granitemoe", "GraniteMoeMoE"),
    _granite("granitemoe_swa", "GraniteMoeSWAMoE"),
    _granite("granitemoeshared", "GraniteMoeSharedMoE"),
    _granite("granitemoehybrid", "GraniteMoeHybridMoE"),
    Family("flint", ("FlintSparseMoeBlock",), TopLogits(gate="sigmoid", kind="sigmoid"), shared=Shared("shared_expert")),
    _qwen3_next("qwen3_next", "Qwen3NextSparseMoeBlock"),
    _qwen3_next("qwen3_5_moe_text", "Qwen3_5MoeSparseMoeBlock", model_types=("qwen3_5_moe",)),
    _deepseek_v3("deepseek_v3", "DeepseekV3MoE"),
    _deepseek_v3("glm4_moe", "Glm4MoeMoE"),
    _deepseek_v3("glm4_moe_lite", "Glm4MoeLiteMoE"),
    _deepseek_v3("glm_moe_dsa", "GlmMoeDsaMoE"),
    _deepseek_v3("deepseek_v32", "DeepseekV32MoE"),
    _deepseek_v3("dots1", "Dots1MoE"),
    _deepseek_v3("dots3_note_text", "Dots3NoteTextMoE", model_types=("dots3_note",)),
    _deepseek_v3("kimi_linear", "KimiLinearMoE"),
    _deepseek_v3("bailing_hybrid", "BailingHybridMoE"),
    _deepseek_v3("solar_open", "SolarOpenMoE"),
    _deepseek_v3("exaone_moe", "ExaoneMoeSparseMoEBlock"),
    _deepseek_v3("hy_v4", "HYV4MoE"),
    _deepseek_v3("mimo_v2_flash", "MiMoV2FlashMoE", shared=None),
    _deepseek_v3("nemotron_h", "NemotronHMoE", norm="norm", layer=LatentLayer),
    Family("beam", ("BeamMoE",), DSV3, norm="pre_feedforward_layernorm", scale=_routed_scaling),
    Family("deepseek_v2", ("DeepseekV2Moe",), BiasedScores(
        score="softmax", bias=None, kind="softmax, group-max limited",
        groups=GroupLimit(top=1, fill=0.0, when=lambda lay: lay.router.topk_method == "group_limited_greedy"),
    ), shared=SHARED),
    Family("ernie4_5_moe", ("Ernie4_5_MoeSparseMoeBlock",), BiasedScores(
        score="softmax", bias="router.moe_statics.e_score_correction_bias", kind="softmax+bias"), shared=SHARED),
    Family("longcat_flash", ("LongcatFlashMoE",), BiasedScores(score="softmax", kind="softmax+bias, zero experts"),
           router_attr="router", norm="post_attention_layernorm.0", num_experts="router.n_routed_experts",
           zero_experts="experts.num_routed_experts", layer=TwoSlotLayer),
    Family("minimax_m2", ("MiniMaxM2SparseMoeBlock",), BLOCK_BIAS, router_args=("block.e_score_correction_bias",)),
    Family("hy_v3", ("HYV3MoE",), BLOCK_BIAS, router_args=("block.e_score_correction_bias",), shared=SHARED),
    Family("afmoe", ("AfmoeSparseMoeBlock",), BiasedScores(bias="block.expert_bias", kind="sigmoid+bias"),
           router_attr="router", router_args=("block.expert_bias",), router_3d=True, norm="pre_mlp_layernorm",
           shared=SHARED),
    Family("lfm2_moe", ("Lfm2MoeSparseMoeBlock",), BiasedScores(bias="block.expert_bias", fp32=False, kind="sigmoid+bias"),
           router_args=("block.expert_bias",), norm="ffn_norm"),
    Family("laguna", ("LagunaSparseMoeBlock",), BiasedScores(kind="softcapped sigmoid+bias"), scale=_routed_scaling,
           shared=SHARED),
    Family("minimax_m3_vl_text", ("MiniMaxM3VLSparseMoeBlock",), BiasedScores(kind="sigmoid+bias"), gain="1+w",
           scale=_routed_scaling, shared=SHARED),
    Family("kolibri1", ("Kolibri1SparseMoeBlock",), BiasedScores(score="identity", gate="sigmoid", kind="logits+bias"),
           shared=SHARED),
    Family("deepseek_v4", ("DeepseekV4SparseMoeBlock",), BiasedScores(score="router.score_fn", fp32=False,
                                                                      kind="sqrtsoftplus+bias"),
           shared=SHARED, skip=lambda block: "hash-routed (a fixed token-id table)" if block.is_hash else None),
    Family("inkling_text", ("InklingMoE",), BiasedScores(kind="sigmoid+bias, shared experts in the normalisation"),
           layer=RouterGatedSharedLayer, model_types=("inkling_mm_model",)),
    Family("inkling2_text", ("Inkling2SparseMoeBlock",), BiasedScores(score="router.score_fn", fp32=False,
                                                                     kind="sigmoid+bias")),
    Family("llama4_text", ("Llama4TextMoe",), TopLogits(gate="sigmoid", read=llama4_read, kind="sigmoid top-k, input-scaled"),
           router_attr="router", shared=Shared("shared_expert"), layer=InputScaledLayer, model_types=("llama4",)),
    Family("jetmoe", ("JetMoeMoE",), TopLogits(read=jetmoe_read, kind="topk_softmax"), router_attr="router",
           experts="input_linear", layer=JetMoeLayer),
    # mean-centred LayerNorm pre-norms (docs/receipts.md#layernorm-state)
    Family("dbrx", ("DbrxFFN",), BiasedScores(score="softmax", bias=None, fp32=False, read=block_read,
                                              kind="softmax (ranked in the logits' dtype)"),
           router_attr="router", norm="norm_attn_norm.norm_2", norm_type="layernorm",
           num_experts="experts.num_experts", top_k="block.top_k", layer=FlatOutputLayer),
    Family("cohere2_moe", ("Cohere2MoeSparseMoeBlock",),
           TopLogits(gate="router.expert_selection_fn", kind="topk_softmax or topk_sigmoid (expert_selection_fn)"),
           norm="input_layernorm", norm_type=_norm_class, scale=_shared_average,
           shared=Shared("shared_experts", scale=_shared_average)),
    Family("phimoe", ("PhimoeSparseMoeBlock",), TopLogits(kind="sparsemixer: top-2 logits, masked-softmax weights"),
           router_attr="router", norm_type="layernorm", top_k=2),
    # the text models of composite (vision-language) checkpoints
    Family("qwen3_vl_moe", ("Qwen3VLMoeTextSparseMoeBlock",), SOFTMAX),
    _deepseek_v3("glm4v_moe", "Glm4vMoeTextMoE"),
    Family("mistral4", ("Mistral4MoE",), BiasedScores(score="softmax", bias=None, fp32=False, groups=GroupLimit(fill=0.0),
                                                      kind="softmax, group-limited (mask filled with 0)"), shared=SHARED),
)

REFUSED: dict[str, tuple[tuple[str, ...], str]] = {
    "flex_olmo": (("FlexOlmoSparseMoeBlock",), "post-norm block: the router reads the raw residual stream (its norm "
                  "comes after the block), so there is no gate input g = Gamma z"),
    "doge": (("DogeCDMoE",), "its product-key router views the logits of a batch as [2, tokens, keys], mixing "
             "different tokens' logits, so a token's choice is not a function of its own gate input"),
    "zaya": (("ZayaSparseMoeBlock",), "its router reads router state carried from the previous layer (EDA), so "
             "routing is not a function of the gate input and anchors cannot be re-routed"),
    "gemma4_text": (("Gemma4TextRouter",), "no MoE block module (the decoder layer calls router and experts inline), "
                    "and the router normalises the residual itself while the experts read pre_feedforward_layernorm_2"),
    "qwen4_exp_text": (("Qwen4ExpTextSparseMoeBlock",), "the MoE input is a hyper-connection mix of several "
                       "normalised residual streams (Qwen4ExpTextGatedResidual), not Gamma z of one RMS-normalised state"),
    "axk2": (("AXK2MoE",), "its pre-norm multiplies by an input-dependent sigmoid gate (AXK2GatedRMSNorm), so the "
             "gate input is not Gamma z with a fixed gain"),
    "axk1": (("AXK1MoE",), "the block RMS-normalises its own output (post_mlp_layernorm inside AXK1MoE), so its "
             "update is not sum_e w_e u_e + shared"),
}
"""Family -> (block classes, why its routed block cannot be read exactly)."""
REFUSED_ALIASES = {"gemma4": "gemma4_text", "qwen4_exp": "qwen4_exp_text"}
"""Composite model types whose text model is a refused family."""
NOT_MOE = {
    "bamba": "dense hybrid Mamba model: its modeling code names experts only in shared Mamba helpers",
}
"""Causal-LM model types whose modeling code mentions experts but that hold no routed MoE block."""

register_rows(FAMILIES, REFUSED)
