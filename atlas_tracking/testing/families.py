"""Tiny random models of every supported transformers MoE family (the architecture code is transformers' own).

``CONFIGS`` holds, per family (transformers model type), what its tiny config needs beyond ``COMMON``
(2 layers, hidden 32, 8 experts, top-2: the keys a config does not have are left out).
"""

from __future__ import annotations

import contextlib
import inspect
import re

import numpy as np
import torch

from atlas_tracking import AtlasConfig, Baseline, Canary, measure
from atlas_tracking.artifacts.gate_report import verify

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
              num_experts=8, num_local_experts=8, n_routed_experts=8, num_experts_per_tok=2,
              shared_expert_intermediate_size=40, n_group=4, topk_group=2, first_k_dense_replace=1,
              n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
              v_head_dim=8, pad_token_id=0)
MLA = dict(num_key_value_heads=4)
"""Multi-head latent attention wants as many key-value heads as heads."""
SPARSE2 = dict(mlp_layer_types=["sparse", "sparse"])

CONFIGS: dict[str, dict] = {
    "mixtral": dict(num_local_experts=6),
    "qwen2_moe": dict(num_experts=6),
    "qwen3_moe": dict(num_experts=6),
    "olmoe": dict(num_experts=6, intermediate_size=24),
    "minimax": {},
    "mellum": {},
    "hunyuan_v1_moe": dict(moe_topk=2),
    "jamba": dict(expert_layer_period=1, expert_layer_offset=0, mamba_d_state=4, mamba_expand=1, mamba_dt_rank=4),
    "gpt_oss": dict(num_local_experts=6, intermediate_size=24),
    "aria_text": dict(moe_num_experts=8, moe_topk=2, moe_num_shared_experts=1),
    "granitemoe": {},
    "granitemoe_swa": {},
    "granitemoeshared": dict(shared_intermediate_size=40),
    "granitemoehybrid": dict(shared_intermediate_size=40, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                             mamba_expand=2, mamba_chunk_size=8, layer_types=["mamba", "attention"]),
    "flint": dict(mlp_only_layers=[]),
    "qwen3_next": dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4),
    "qwen3_5_moe_text": dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                             linear_num_value_heads=4),
    "deepseek_v3": dict(MLA, n_routed_experts=8, num_hidden_layers=3, routed_scaling_factor=2.5, norm_topk_prob=True),
    "glm4_moe": dict(routed_scaling_factor=2.5),
    "glm4_moe_lite": dict(MLA),
    "glm_moe_dsa": dict(MLA, index_n_heads=2, index_head_dim=8, index_topk=4),
    "deepseek_v32": dict(MLA, index_n_heads=2, index_head_dim=8, index_topk=4),
    "dots1": {},
    "dots3_note_text": dict(MLA, index_n_heads=2, index_head_dim=8, index_topk=4, shared_experts_intermediate_size=24),
    "kimi_linear": dict(num_experts_per_token=2, num_expert_group=4, topk_group=2, linear_head_dim=8, linear_num_heads=4),
    "bailing_hybrid": {},
    "solar_open": {},
    "exaone_moe": {},
    "hy_v4": dict(MLA),
    "mimo_v2_flash": {},
    "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=8, moe_shared_expert_intermediate_size=40, n_groups=1,
                       ssm_state_size=8, chunk_size=8),
    "beam": dict(SPARSE2),
    "deepseek_v2": dict(MLA, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5),
    "ernie4_5_moe": dict(moe_num_experts=8, moe_k=2, moe_layer_start_index=0, moe_num_shared_experts=1),
    "longcat_flash": dict(MLA, moe_topk=2, zero_expert_num=2, expert_ffn_hidden_size=24, ffn_hidden_size=48, num_layers=2),
    "minimax_m2": {},
    "hy_v3": {},
    "afmoe": {},
    "lfm2_moe": dict(num_dense_layers=0, layer_types=["full_attention", "conv"]),
    "laguna": dict(moe_routed_scaling_factor=2.0),
    "minimax_m3_vl_text": dict(routed_scaling_factor=2.0, shared_intermediate_size=40, dense_intermediate_size=48),
    "kolibri1": {},
    "deepseek_v4": dict(mlp_layer_types=["hash_moe", "moe"], hc_mult=2),
    "inkling_text": dict(n_shared_experts=1, mlp_layer_types=["sparse", "sparse"]),
    "inkling2_text": {},
    "llama4_text": dict(intermediate_size_mlp=48, interleave_moe_layer_step=1),
    "jetmoe": dict(kv_channels=8, num_key_value_heads=4),
    # composite (vision-language) models: their text model's config, and a one-block vision tower
    "qwen3_vl_moe": dict(text_config=dict(num_experts=8, rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1]}),
                         vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=4,
                                            out_hidden_size=32, num_position_embeddings=64)),
    "glm4v_moe": dict(text_config=dict(rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                                                        "partial_rotary_factor": 1.0}),
                      vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=32)),
    "mistral4": dict(MLA, routed_scaling_factor=1.5),
    # mean-centred LayerNorm pre-norms: DBRX's without a bias, Cohere2-MoE's (with averaged shared experts), PhiMoE's
    # with one. DBRX's attention reads attn_config.rope_theta, which its config class does not declare, and clamps
    # with clip_qkv, which must then be set.
    "dbrx": dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=128,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=24, moe_num_experts=8, moe_top_k=2)),
    "cohere2_moe": dict(num_shared_experts=1, sliding_window_pattern=2, bos_token_id=1, eos_token_id=2),
    "phimoe": {},
}
FAMILIES = tuple(CONFIGS)
ORIGINAL = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


def family_config(name: str, **overrides: object):
    """The tiny config of family ``name``: ``COMMON`` (the keys its config class has), ``CONFIGS[name]`` and
    ``overrides``; a composite config gets them in its ``text_config``."""
    from transformers import AutoConfig

    extra = {**CONFIGS[name], **overrides}
    default = AutoConfig.for_model(name)
    if "text_config" in extra:
        text = type(default.text_config)
        extra["text_config"] = {**_common(text), **extra["text_config"]}
        return AutoConfig.for_model(name, **extra)
    return AutoConfig.for_model(name, **{**_common(type(default)), **extra})


def _common(cls) -> dict:
    fields = set(inspect.signature(cls.__init__).parameters) | set(getattr(cls, "__dataclass_fields__", {}))
    return {k: v for k, v in COMMON.items() if k in fields}


def family_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: object):
    """A tiny random model of family ``name`` (config keys ``overrides`` replaced), in eval mode, with routers and
    norm gains given spread (a fresh model's zero routers and unit gains would make routing and the gain
    convention degenerate)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from atlas_tracking.adapters import find_routed_layers

    torch.manual_seed(seed)
    config = family_config(name, **overrides)
    try:
        model = AutoModelForCausalLM.from_config(config).eval()
    except ValueError:  # a composite model: measured through its text model
        model = AutoModelForImageTextToText.from_config(config).eval()
    spread(find_routed_layers(model))
    return to_dtype(model, dtype)


def spread(layers) -> None:
    """Give routers, their biases, the norm gains and LayerNorm biases spread (fresh ones are zero, ones or tiny)."""
    with torch.no_grad():
        for lay in layers:
            tensors = [*lay.router.named_parameters(), *lay.router.named_buffers(),
                       *((n, t) for n, t in lay.block.named_parameters(recurse=False) if "bias" in n),
                       *((n, t) for n, t in lay.block.named_buffers(recurse=False) if "bias" in n)]
            for tname, t in tensors:
                if t.is_floating_point():
                    t.normal_(0, 0.1 if "bias" in tname else 0.5)
            lay.norm.weight.add_(torch.randn_like(lay.norm.weight) * 0.1)
            if lay.beta() is not None:
                lay.norm.bias.normal_(0, 0.1)


def to_dtype(model, dtype: torch.dtype):
    """``model`` in ``dtype`` as transformers loads it: the modules it keeps in fp32 stay in fp32 (the strict
    list always, the other one in fp16 only)."""
    keep = [*(getattr(model, "_keep_in_fp32_modules_strict", None) or []),
            *((getattr(model, "_keep_in_fp32_modules", None) or []) if dtype == torch.float16 else [])]
    patterns = [re.compile(rf"(^|\.){re.escape(k)}(\.|$)") for k in keep]
    model.to(dtype)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and any(p.search(name) for p in patterns):
            t.data = t.data.float()
    return model


def capture_layers(model, ids, forward=None):
    """One forward with hooks of our own on every routed layer's norm, router, experts and block: the layers and,
    per layer name, what each hook saw (``x``, ``g``, ``router``, ``out``, and ``index``: the active sets the
    model handed its experts, when they are called as ``experts(x, top_k_index, top_k_weights)``). ``forward``:
    ``(model, ids)`` for models that are not transformers causal LMs."""
    from atlas_tracking.adapters import find_routed_layers

    layers = find_routed_layers(model)
    seen = {lay.name: {} for lay in layers}
    handles = []
    for lay in layers:
        d = seen[lay.name]
        handles.append(lay.norm.register_forward_hook(lambda m, i, o, d=d: d.update(x=i[0], g=o)))
        handles.append(lay.router.register_forward_hook(lambda m, i, o, d=d: d.update(router=o)))
        handles.append(lay.block.register_forward_hook(lambda m, i, o, d=d: d.update(out=o[0] if isinstance(o, tuple) else o)))
        if lay.fusable:
            handles.append(lay.experts.register_forward_hook(lambda m, i, o, d=d: d.update(index=i[1])))
    ids = ids.to(next(model.parameters()).device)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False) if forward is None else forward(model, ids)
    for h in handles:
        h.remove()
    return layers, seen


# --- the exactness checks every supported family passes (transformers, LitGPT, torchtitan) ---------------------

CFG = AtlasConfig.from_dict({"receipts": {"progress": False, "batch_windows": 4, "anchors": 24, "n_bootstrap": 20}})
DRIFT = ("coord_drift", "boundary_drift", "transition_drift", "content_drift")


def recombined(lay, g, routing):
    """``sum_e w_e u_e(g) + shared(g)`` in fp32, with the model's own experts."""
    with torch.no_grad():
        u = lay.expert_outputs(g, routing.active)
        combined = (routing.weights.unsqueeze(-1) * u.float()).sum(1)
        shared = lay.shared_output(g)
    return combined if shared is None else combined + shared.float().reshape(combined.shape)


def check_exact(family, model, forward=None):
    """Active sets are the model's (as handed to its experts, and a top-k of the adapter's scores), and
    ``sum w u + shared`` is the block's output within 1e-5 relative."""
    ids = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(1))
    layers, seen = capture_layers(model, ids, forward)
    assert layers, family
    for lay in layers:
        d = seen[lay.name]
        g = d["g"].reshape(-1, d["g"].shape[-1])
        routing = lay.routing(d["router"], g)
        if "index" in d:  # the sets the model handed its experts in this forward
            theirs = d["index"].reshape(len(g), -1)
            assert [set(r) for r in routing.active.tolist()] == [set(r) for r in theirs.tolist()], lay.name
        kth = routing.scores.gather(1, routing.active).min(1).values
        outside = routing.scores.scatter(1, routing.active, float("-inf")).max(1).values
        assert bool((kth >= outside).all()), lay.name  # the model's choice is a top-k of the adapter's scores
        out = d["out"].reshape(len(g), -1).float()
        rel = (recombined(lay, g, routing) - out).norm() / out.norm()
        assert rel < 1e-5, (family, lay.name, float(rel))
        ones = torch.ones(len(g), device=g.device)
        assert torch.allclose(routing.rho.sum(1), ones, atol=1e-5)
        assert torch.allclose(routing.probs.sum(1), ones, atol=1e-5)
        assert routing.scores.shape[1] == lay.num_experts and routing.active.shape[1] == lay.top_k


def check_bf16(family, model, forward=None):
    """In bf16 (as transformers loads it) the adapter's fp32 scores reproduce the model's choice (ties aside)."""
    ids = torch.randint(0, 64, (4, 24), generator=torch.Generator().manual_seed(2))
    layers, seen = capture_layers(to_dtype(model, torch.bfloat16), ids, forward)
    for lay in layers:
        d = seen[lay.name]
        routing = lay.routing(d["router"], d["g"].reshape(-1, d["g"].shape[-1]))
        ours = routing.scores.topk(lay.top_k, dim=1).indices
        theirs = d["index"].reshape(len(ours), -1).long() if "index" in d else routing.active
        kth = routing.scores.gather(1, theirs).min(1).values
        outside = routing.scores.scatter(1, theirs, float("-inf")).max(1).values
        ties = kth == outside  # exact ties in the model's own scores: either choice is the model's
        same = torch.tensor([set(a) == set(b) for a, b in zip(ours.tolist(), theirs.tolist())], device=ties.device)
        assert bool((same | ties).all()), (family, lay.name)
        assert bool((kth >= outside).all()), (family, lay.name)


def check_canary() -> Canary:
    """The canary of ``check_measure``: four windows of 16 tokens of the tiny vocabulary."""
    return Canary.from_token_ids(np.arange(400) * 7 % 64, window=16, n_windows=4, seed=0)


def check_measure(model, forward=None):
    """``measure`` + ``verify`` pass (the self-check included) and the model compared with itself drifts by 0."""
    canary = check_canary()
    kw = {} if forward is None else {"forward": forward}
    report = measure(model, canary, config=CFG, **kw)
    assert verify(report.to_dict()) == []
    assert all(lay["selfcheck"]["recombination"] is not None for lay in report.layers)
    check_ranges(report.to_dict())
    again = measure(model, canary, baseline=Baseline.from_report(report), config=CFG, **kw)
    assert verify(again.to_dict()) == []
    for lay in again.drift["layers"]:
        assert [lay[k] for k in DRIFT] == [0.0] * 4, lay["name"]


def check_ranges(report: dict) -> None:
    """Every receipt stated with a range stays inside it, in every layer, window and CI (docs/receipts.md): the
    cosines, overlaps and redundancy distances of ``RANGES``, every boundary mass in ``[0, 1]``, every set-margin
    statistic ``>= 0``."""
    from atlas_tracking.receipts.windows import RANGES

    for layer, pw in zip(report["layers"], report["per_window"]["layers"]):
        r, name = layer["receipts"], layer["name"]
        bounded = {**RANGES, **{key: (0.0, 1.0) for key in r if key.startswith("boundary_mass@")}}
        for key, (lo, hi) in bounded.items():
            values = [r.get(key), *(layer["ci"].get(key) or [])]
            assert all(lo <= v <= hi for v in values if v is not None), (name, key, values)
        for key, (lo, hi) in RANGES.items():
            s, c = np.asarray(pw[key]["sum"], float), np.asarray(pw[key]["count"], float)
            means = s[c > 0] / c[c > 0]
            assert bool(((means >= lo) & (means <= hi)).all()), (name, key, means)
        assert all(r[key] is None or r[key] >= 0 for key in ("margin_mean", "margin_p10", "margin_p50")), name


OWN_CANARY = dict(window=16, n_windows=10)
"""Three micro-batches of four windows: the first (where a layer compares its combine with the model's own call),
one the combine answers, and the last, padded: every kind of call a gate makes."""


def _seen_in_forward(model, layers, run, route: bool = False) -> dict[str, list]:
    """Per layer, per call of its MoE block inside the model's forward: the block's output, the expert indices
    the model handed its experts there and, with ``route``, the active sets ``[N, k]`` the adapter's routing reads
    from the router's own first call in the block (hooks of the test's own, registered before a gate's, so calls a
    gate makes from its own hooks are not seen)."""
    seen = {lay.name: [] for lay in layers}
    inside: dict[str, bool] = {}
    handles = []
    for lay in layers:
        calls = seen[lay.name]

        def pre(m, i, name=lay.name, calls=calls):
            inside[name] = True
            calls.append({"index": [], "active": None})

        def post(m, i, o, name=lay.name, calls=calls):
            inside[name] = False
            calls[-1]["out"] = (o[0] if isinstance(o, tuple) else o).detach().clone()

        def experts(m, i, o, name=lay.name, calls=calls):
            if inside.get(name):
                calls[-1]["index"].append(i[1].detach().clone())

        def router(m, i, o, name=lay.name, calls=calls, lay=lay):
            if inside.get(name) and calls[-1]["active"] is None:
                calls[-1]["active"] = lay.routing(o, i[0].reshape(-1, i[0].shape[-1])).active.detach().clone()

        handles += [lay.block.register_forward_pre_hook(pre), lay.block.register_forward_hook(post)]
        if lay.fusable:
            handles.append(lay.experts.register_forward_hook(experts))
        if route:
            handles.append(lay.router.register_forward_hook(router))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return seen


def check_own_forward(family, model, autocast: torch.dtype | None = None, fuse: bool = True) -> None:
    """A gate's forward is the model's own: in every routed layer and every call, the block's output equals the
    plain forward's bit for bit and, where the layer hands its experts indices (fusable), the model hands them the
    same ones; in every routed layer, fused or not, the gate's per-window expert loads are the counts of the
    model's own choice, read through the adapter's routing from the router's call in the plain forward (so its dead
    experts are the model's). Every routed layer is compared: a layer whose router the plain forward did not call
    fails. ``autocast``: both forwards run under ``torch.autocast`` in that dtype, as a mixed-precision run
    validates."""
    from atlas_tracking.adapters import find_routed_layers
    from atlas_tracking.engine.measure import _forward_ids, micro_batches

    canary = Canary.from_token_ids(np.arange(2000) * 7 % 64, seed=0, **OWN_CANARY)
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "batch_windows": 4, "anchors": 24,
                                              "n_bootstrap": 20, "fuse_experts": fuse}})
    layers = find_routed_layers(model)
    context = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast else contextlib.nullcontext
    batches = micro_batches(canary, 0, 1, 4)

    def plain():
        with context():
            for b in batches:
                model(input_ids=torch.as_tensor(_forward_ids(canary, b), dtype=torch.long), use_cache=False)

    reports = []

    def gate():
        with context():
            reports.append(measure(model, canary, config=cfg))

    theirs, ours = _seen_in_forward(model, layers, plain, route=True), _seen_in_forward(model, layers, gate)
    report = reports[0]
    assert verify(report.to_dict()) == [], family
    assert len(report.per_window["layers"]) == len(layers) > 0, family
    for lay, pw in zip(layers, report.per_window["layers"]):
        a, b = theirs[lay.name], ours[lay.name]
        assert len(a) == len(b) == len(batches), (family, lay.name, len(a), len(b))
        loads = np.zeros((canary.n_windows, lay.num_experts), dtype=np.int64)
        for batch, call_a, call_b in zip(batches, a, b):
            assert torch.equal(call_a["out"], call_b["out"]), (family, lay.name, batch, "block output")
            assert len(call_a["index"]) == len(call_b["index"]), (family, lay.name)
            assert len(call_a["index"]) > 0 or not lay.fusable, (family, lay.name, "no experts call seen")
            for ia, ib in zip(call_a["index"], call_b["index"]):
                assert torch.equal(ia, ib), (family, lay.name, batch, "experts' indices")
            active = call_a["active"]
            assert active is not None, (family, lay.name, batch, "the router was not called in the block")
            assert active.shape == (batch.size * canary.window, lay.top_k), (family, lay.name, active.shape)
            per_window = active.reshape(batch.size, canary.window, -1)[: batch.end - batch.start].long()
            for w, chosen in enumerate(per_window):
                loads[batch.start + w] += np.bincount(chosen.reshape(-1).numpy(), minlength=lay.num_experts)[
                    : lay.num_experts]
        assert np.array_equal(np.asarray(pw["load"]), loads), (family, lay.name, "loads")
