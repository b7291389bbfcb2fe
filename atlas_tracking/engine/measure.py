"""``measure``: one no-grad forward over the canary with capture hooks -> a :class:`GateReport`.

Example (a tiny random Qwen3-MoE; transformers supplies the architecture code):
    >>> import numpy as np, torch
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> from atlas_tracking import AtlasConfig, Canary, measure
    >>> _ = torch.manual_seed(0)
    >>> cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
    ...                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    ...                      num_experts=8, num_experts_per_tok=2)
    >>> model = Qwen3MoeForCausalLM(cfg)
    >>> canary = Canary.from_token_ids(np.arange(2000) % 64, window=32, n_windows=8, seed=0)
    >>> report = measure(model, canary, config=AtlasConfig.from_dict({"receipts": {"progress": False}}))
    >>> [layer["name"] for layer in report.layers]
    ['model.layers.0.mlp', 'model.layers.1.mlp']
    >>> report.layers[0]["receipts"]["pi_sum"]   # sum_e pi_e = k
    2.0
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from atlas_tracking.adapters.base import RoutedLayer, find_routed_layers
from atlas_tracking.artifacts.derivation import derive, derive_drift
from atlas_tracking.artifacts.gate_report import GateReport, model_fingerprint
from atlas_tracking.artifacts.handoff_reference import HandoffReference
from atlas_tracking.artifacts.tensor_spool import TensorSpool
from atlas_tracking.engine.anchor_storage import AnchorStorage, configured_storage
from atlas_tracking.engine.anchors import AnchorPlan
from atlas_tracking.engine.canary import Canary, check_canary_fits
from atlas_tracking.engine.capture import (
    LayerAccumulator,
    LayerCapture,
    MicroBatch,
    host_per_window,
    merge_hosts,
    spool_collected,
)
from atlas_tracking.engine.collectives import checkpoint
from atlas_tracking.engine.coupling import (
    NO_ROWS,
    baseline_means,
    baseline_tensors,
    capture_sums,
    comovement_entry,
    expert_means,
    merge,
    window_entry,
)
from atlas_tracking.engine.free_memory import free_bytes
from atlas_tracking.engine.kernels import PROCESS_KERNELS
from atlas_tracking.engine.pooled_competitors import pool_budget
from atlas_tracking.engine.selfcheck import check_layers
from atlas_tracking.engine.sharding import model_class_name, reshard
from atlas_tracking.engine.transfer import read_back
from atlas_tracking.receipts.kl import base_topk, window_kl
from atlas_tracking.receipts.lifecycle import protected_ordinals
from atlas_tracking.receipts.nll import window_nll
from atlas_tracking.schema.artifacts import KL_TENSORS
from atlas_tracking.schema.config import AtlasConfig, ReceiptsConfig

ForwardFn = Callable[[nn.Module, torch.Tensor], "torch.Tensor | None"]
"""(model, input_ids [B, L]) -> next-token logits [B, L, V], or None when there is no LM head."""


class RouterLogitsError(FloatingPointError):
    """Router logits held NaN or Inf during a gate."""


class RankDisagreementError(ValueError):
    """The processes of a distributed gate were not given the same canary or micro-batch size."""


def default_forward(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Forward a transformers-style causal LM (or any module returning logits)."""
    if hasattr(model, "config") and hasattr(model, "get_input_embeddings"):
        out = model(input_ids=input_ids, use_cache=False)
    else:
        out = model(input_ids)
    if isinstance(out, torch.Tensor):
        return out
    return getattr(out, "logits", None)


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class _Progress:
    """Canary progress on stderr: one rewritten line on a terminal; on a file or pipe (a log), plain
    lines, at most one every ``LOG_EVERY_S`` seconds plus the last."""

    LOG_EVERY_S = 10.0

    def __init__(self, total: int, enabled: bool, callback: Callable[[int, int], None] | None):
        self.total, self.done = total, 0
        self.enabled, self.callback = enabled and total > 1, callback
        self.t0 = self.shown = time.perf_counter()
        self.tty = self.enabled and sys.stderr.isatty()

    def step(self, windows: int) -> None:
        self.done += windows
        if self.callback is not None:
            self.callback(self.done, self.total)
            return
        if not self.enabled:
            return
        now = time.perf_counter()
        line = f"atlas: {self.done}/{self.total} canary windows ({self.done / max(now - self.t0, 1e-9):.1f}/s)"
        last = self.done >= self.total
        if self.tty:
            print("\r" + line, end="\n" if last else "", file=sys.stderr, flush=True)
        elif last or now - self.shown >= self.LOG_EVERY_S:
            self.shown = now
            print(line, file=sys.stderr, flush=True)


def micro_batches(canary: Canary, rank: int, world_size: int, batch_windows: int) -> list[MicroBatch]:
    """This rank's forward calls of a gate: its share of the canary's micro-batches (round-robin), then
    filler calls up to the largest share, so every rank makes the same number of calls whatever its share.

    Every call has ``min(batch_windows, n_windows)`` windows: the micro-batches are those of every world
    size, a short last one is padded, and a filler computes the first windows again and keeps nothing.

    >>> import numpy as np
    >>> c = Canary(windows=np.zeros((5, 4), dtype=np.int64))
    >>> [(b.start, b.end, b.size, b.keep) for b in micro_batches(c, rank=1, world_size=2, batch_windows=2)]
    [(2, 4, 2, True), (0, 2, 2, False)]
    """
    size = min(batch_windows, canary.n_windows)
    own = canary.shard(rank, world_size, size)
    calls = -(-len(canary.batches(size)) // world_size)
    return ([MicroBatch(start, end, size) for start, end in own]
            + [MicroBatch(0, size, size, keep=False)] * (calls - len(own)))


def _forward_ids(canary: Canary, batch: MicroBatch) -> np.ndarray:
    """The token ids of one forward call: its windows, then the canary's first windows as padding."""
    ids = canary.windows[batch.start : batch.end]
    pad = batch.size - len(ids)
    return np.concatenate([ids, canary.windows[:pad]]) if pad else ids


def check_ranks_agree(canary: Canary, config: AtlasConfig, world_size: int) -> None:
    """Every process of a distributed gate holds the same canary and micro-batch size; otherwise every
    process raises the same :class:`RankDisagreementError` (before any forward call, so nothing hangs)."""
    mine = {"canary": canary.fingerprint, "batch_windows": config.receipts.batch_windows}
    everyone: list[Any] = [None] * world_size
    checkpoint("the canary check")
    torch.distributed.all_gather_object(everyone, mine)
    for key in mine:
        values = [o[key] for o in everyone]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r}: {str(v)[:12]}" for r, v in enumerate(values))
            raise RankDisagreementError(
                f"the processes of this gate disagree on the {key.replace('_', ' ')} ({shown}); every rank "
                "(every rank of an expert-parallel group above all) must measure the same canary with the same "
                "receipts.batch_windows")


def measure_partial(
    model: nn.Module,
    canary: Canary,
    config: AtlasConfig,
    layers: list[RoutedLayer],
    rank: int,
    world_size: int,
    forward: ForwardFn = default_forward,
    progress: Callable[[int, int], None] | None = None,
    anchors: AnchorPlan | None = None,
    collect: bool = False,
    baseline: Any = None,
    post_base: Any = None,
) -> dict[str, Any]:
    """This rank's share of a gate: per-window host arrays for the windows it owns.

    With ``collect`` the anchor tensors a baseline needs are kept (and the base top-K
    log-probabilities, ``receipts.kl_top_k`` of them per predicted token); with a ``baseline`` the
    drift receipts are computed in the same hooks, and ``kl_base`` on the logits; with a post-training
    base ``post_base`` (another baseline) the KL against the base's log-probabilities too (``kl_cumulative``).
    """
    rcfg = config.receipts
    device = _model_device(model)
    batches = micro_batches(canary, rank, world_size, rcfg.batch_windows)
    kept = [(b.start, b.end) for b in batches if b.keep]
    captures = []
    slices = anchors.device_slices(kept, device) if anchors is not None else None
    # drift since the base needs the base's anchors at the baseline's positions (the same receipts.anchors and seed)
    same_anchors = post_base is not None and anchors is not None and np.array_equal(post_base.positions,
                                                                                     anchors.positions)
    storage = anchor_storage(rcfg, layers, anchors) if collect else None  # a ConfigError before any forward
    spool = TensorSpool() if collect else None
    free = free_bytes(device)  # bounds the chunked calls of the experts (docs/receipts.md#memory)
    for i, layer in enumerate(layers):
        acc = LayerAccumulator(canary.n_windows, canary.window, layer.num_experts, rcfg.boundary_deltas, device)
        base = baseline.layer_reference(i, device) if baseline is not None else None
        since = post_base.layer_reference(i, device) if post_base is not None and same_anchors else None
        captures.append(LayerCapture(layer, acc, rcfg, slices, spool, base, since, storage, index=i, free_memory=free,
                                     pool_bytes=pool_budget(free, len(layers))))
    nll_sum = torch.zeros(canary.n_windows, dtype=torch.float32, device=device)
    nll_cnt = torch.zeros(canary.n_windows, dtype=torch.int64, device=device)
    kl_k = rcfg.kl_top_k if collect else 0
    with_kl = baseline is not None and baseline.kl_absent is None
    kl_sum, kl_cnt = torch.zeros_like(nll_sum), torch.zeros_like(nll_cnt)
    with_klc = post_base is not None and post_base.kl_absent is None
    klc_sum, klc_cnt = torch.zeros_like(nll_sum), torch.zeros_like(nll_cnt)
    topk_parts: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
    owned = np.zeros(canary.n_windows, dtype=bool)
    shown = _Progress(sum(e - s for s, e in kept), rcfg.progress, progress)
    was_training = model.training
    model.eval()
    try:
        for cap in captures:
            cap.attach()
        with torch.no_grad():
            for cap in captures:
                cap.last_batch = batches[-1]
            for batch in batches:
                for cap in captures:
                    cap.batch = batch
                ids = torch.from_numpy(_forward_ids(canary, batch)).to(device)
                logits = forward(model, ids)
                spool_collected(captures)
                if not batch.keep:
                    continue
                start, end = batch.start, batch.end
                if logits is not None:
                    s, c = window_nll(logits[: end - start], ids[: end - start])
                    nll_sum[start:end], nll_cnt[start:end] = s, c
                    if kl_k:
                        topk = base_topk(logits[: end - start], kl_k)
                        topk_parts.append((start, *topk, logits.shape[-1]))
                    if with_kl:
                        base_kl = baseline.kl_base_slice(start, end, logits.shape[-1])
                        kl_sum[start:end], kl_cnt[start:end] = window_kl(logits[: end - start], *base_kl)
                    if with_klc:
                        base_kl = post_base.kl_base_slice(start, end, logits.shape[-1])
                        klc_sum[start:end], klc_cnt[start:end] = window_kl(logits[: end - start], *base_kl)
                owned[start:end] = True
                shown.step(end - start)
    finally:
        for cap in captures:
            cap.detach()
        model.train(was_training)
        reshard(model)
    for cap in captures:
        if cap.calls != len(batches):
            raise RuntimeError(
                f"routed layer {cap.layer.name} ran {cap.calls} times for {len(batches)} canary micro-batches; "
                "is it bypassed by the model's forward?"
            )
        if cap.pool.pending:  # evaluated in the last micro-batch's call of the experts, never skipped
            raise RuntimeError(f"routed layer {cap.layer.name}: {len(cap.pool.pending)} micro-batches' competitors "
                               "were not evaluated by the gate's last call of its experts")
    device_part = {  # read back to the host in one transfer (docs/receipts.md#host-synchronisations)
        "layers": [cap.acc.device_tensors() for cap in captures],
        "nll": (nll_sum, nll_cnt), "kl": (kl_sum, kl_cnt) if with_kl else None,
        "klc": (klc_sum, klc_cnt) if with_klc else None,
        "topk": topk_parts if kl_k else None,
        "gamma": [cap.gamma0 for cap in captures],
        "beta": [cap.beta0 for cap in captures],
        "coupling": [None if cap.rows is None else {"rows": cap.rows, **cap.coupling} for cap in captures],
    }
    host = read_back(device_part)
    return {
        "owned": owned,
        "kernels_fallback": PROCESS_KERNELS.fallback,  # why this process computes its field arithmetic eagerly
        "layers": [cap.acc.from_host(h) for cap, h in zip(captures, host["layers"])],
        **{f"{name}_{part}": None if host[name] is None else t.numpy()
           for name in ("nll", "kl", "klc") for part, t in zip(("sum", "count"), host[name] or (None, None))},
        "topk": host["topk"],
        "anchors": spool,
        "gamma": host["gamma"],
        "beta": host["beta"],
        "coupling": [capture_sums(sums, cap.layer.num_experts, cap.layer.hidden_size)
                     for cap, sums in zip(captures, host["coupling"])],
    }


def _gather(partial: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    if world_size == 1:
        return [partial]
    out: list[Any] = [None] * world_size
    checkpoint("the gather of the receipts")
    torch.distributed.all_gather_object(out, partial)
    return out


def _check_finite(layers: list[RoutedLayer], merged_layers: list[dict[str, Any]]) -> None:
    bad = [
        f"{layer.name} ({int(host['nonfinite_logits'].sum())} tokens)"
        for layer, host in zip(layers, merged_layers)
        if host["nonfinite_logits"].sum() > 0
    ]
    if bad:
        raise RouterLogitsError(f"router logits hold NaN/Inf in routed layer(s): {', '.join(bad)}")


def _window_sums(partials: list[dict[str, Any]], owned: list[np.ndarray], name: str) -> dict[str, np.ndarray]:
    """Per-window ``{"sum", "count"}`` of ``name`` (``nll``, ``kl``), each window from the rank that owns it."""
    n = len(owned[0])
    sums, counts = np.zeros(n), np.zeros(n, dtype=np.int64)
    for p, own in zip(partials, owned):
        sums[own], counts[own] = p[f"{name}_sum"][own], p[f"{name}_count"][own]
    return {"sum": sums, "count": counts}


def build_report(
    partials: list[dict[str, Any]],
    layers: list[RoutedLayer],
    canary: Canary,
    config: AtlasConfig,
    model: nn.Module,
    step: int | None,
    anchors: AnchorPlan | None = None,
    baseline: Any = None,
) -> GateReport:
    """Merge rank partials and derive every receipt (shared with ``verify`` through ``derive``). The partials'
    anchors (their spools) are joined into the report's, with the norms' gains, the base log-probabilities and the
    router rows and expert means co-movement reads later; with a ``baseline``, co-movement's per-expert sums against
    it (docs/receipts.md#router-expert-coupling)."""
    rcfg = config.receipts
    owned = [p["owned"] for p in partials]
    merged = [merge_hosts([p["layers"][i] for p in partials], owned) for i in range(len(layers))]
    _check_finite(layers, merged)
    checks = check_layers(layers, merged, owned, [p["kernels_fallback"] for p in partials])
    protected = set(protected_ordinals(len(layers), config.lifecycle.protected_layers))
    meta = [{**layer.describe(), "ordinal": layer.ordinal, "protected": layer.ordinal in protected,
             "selfcheck": check}
            for layer, check in zip(layers, checks)]
    per_window: dict[str, Any] = {
        "canary_nll": _window_sums(partials, owned, "nll"),
        "layers": [host_per_window(h, rcfg.boundary_deltas) for h in merged],
        "cell_counts": [np.sort(h["cells"][1])[::-1] for h in merged],
    }
    if partials[0]["kl_sum"] is not None:
        per_window["kl_base"] = _window_sums(partials, owned, "kl")
    if partials[0].get("klc_sum") is not None:
        per_window["kl_cumulative"] = _window_sums(partials, owned, "klc")
    means = []
    for i, (layer, h, pw) in enumerate(zip(layers, merged, per_window["layers"])):
        sums = merge([p["coupling"][i] for p in partials])
        pw["alignment"] = {"absent": NO_ROWS} if sums is None else window_entry(h["align_dot"], sums, h["load"])
        means.append(None if sums is None else expert_means(sums, h["load"].sum(axis=0), layer.zero_experts))
        if baseline is not None:
            pw["comove"] = comovement_entry(means[-1], baseline_means(baseline.tensors, i),
                                            AnchorStorage.of(baseline.storage).store_fields)
    exact = [dict(zip(("margin_p10", "margin_p50"), q)) for q in margin_quantiles([h["margin"] for h in merged])]
    layer_dicts, summ = derive(meta, per_window, canary.n_windows, canary.window, config.to_dict()["receipts"], exact)
    model_info = {
        "class": model_class_name(model),
        "families": sorted({layer.family for layer in layers}),
        "fingerprint": model_fingerprint(model_class_name(model), meta),
        "deterministic_routing": all(layer.deterministic_routing for layer in layers),
    }
    canary_info = {
        "fingerprint": canary.fingerprint,
        "n_windows": canary.n_windows,
        "window": canary.window,
        "seed": canary.seed,
    }
    report = GateReport(
        step=step,
        canary=canary_info,
        model=model_info,
        config={"receipts": config.to_dict()["receipts"], "lifecycle": config.to_dict()["lifecycle"]},
        layers=layer_dicts,
        summary=summ,
        per_window=per_window,
    )
    if partials[0]["anchors"] is not None and anchors is not None:
        storage = anchor_storage(rcfg, layers, anchors)
        tensors = TensorSpool.joined([p["anchors"] for p in partials])
        for i in range(len(layers)):
            for key, norm in (("gamma0", partials[0]["gamma"][i]), ("beta0", partials[0]["beta"][i])):
                if norm is not None:
                    tensors.add(f"{i}.{key}", 0, norm)
            stored = baseline_tensors(i, means[i], storage.store_fields) if means[i] is not None else {}
            for key, vectors in stored.items():
                tensors.add(key, 0, vectors)
        kl = merge_topk([p["topk"] for p in partials], canary.n_windows, rcfg.kl_top_k)
        for key in KL_TENSORS:
            if key in kl:
                tensors.add(f"kl.{key}", 0, kl.pop(key))
        report.anchors = {
            "tensors": tensors,
            "positions": anchors.positions.tolist(),
            "batch_windows": rcfg.batch_windows,
            "storage": storage.describe(len(anchors.positions), max(lay.top_k for lay in layers)),
            "kl": kl,
        }
    return report


def margin_quantiles(margins: list[np.ndarray]) -> list[list[float | None]]:
    """Each layer's exact ``[p10, p50]`` of its finite per-token margins (``[W, L]``, NaN where a token has none; None
    for a layer with none), in float64; layers with as many finite margins in one quantile call.

    >>> margin_quantiles([np.array([[0.1, 0.3], [0.2, np.nan]]), np.array([[0.4, 0.6], [0.5, 0.5]]), np.full((1, 2), np.nan)])
    [[0.12000000000000001, 0.2], [0.43000000000000005, 0.5], [None, None]]
    """
    finite = [m[np.isfinite(m)].astype(np.float64) for m in margins]
    out: list[list[float | None]] = [[None, None]] * len(finite)
    for size in {m.size for m in finite} - {0}:
        same = [i for i, m in enumerate(finite) if m.size == size]
        for i, q in zip(same, np.quantile(np.stack([finite[i] for i in same]), [0.1, 0.5], axis=1).T.tolist()):
            out[i] = q
    return out


def anchor_storage(rcfg: ReceiptsConfig, layers: list[RoutedLayer], anchors: AnchorPlan | None) -> AnchorStorage:
    """How this gate stores the anchors it collects (docs/receipts.md#compact-anchors)."""
    n = 0 if anchors is None else len(anchors.positions)
    return configured_storage(rcfg, [(lay.hidden_size, lay.top_k, lay.num_experts) for lay in layers], n)


def merge_topk(parts: list[Any], n_windows: int, top_k: int) -> dict[str, Any]:
    """The ranks' base top-K micro-batches in window order (``logp``, ``index``, ``log_rest`` and the
    logits' ``vocab_size``), or the reason they are absent (``{"absent": why}``)."""
    if top_k == 0:
        return {"absent": "receipts.kl_top_k was 0 when this baseline was measured"}
    pieces = sorted((q for p in parts if p for q in p), key=lambda q: q[0])
    if sum(q[1].shape[0] for q in pieces) != n_windows:
        return {"absent": "the forward returned no logits for some canary windows"}
    logp, index, log_rest = (torch.cat([q[i] for q in pieces]).contiguous() for i in (1, 2, 3))
    return {"logp": logp, "index": index, "log_rest": log_rest, "vocab_size": pieces[0][4]}


def measure(
    model: nn.Module,
    canary: Canary,
    baseline: Any = None,
    config: AtlasConfig | dict | str | None = None,
    *,
    step: int | None = None,
    layers: list[RoutedLayer] | None = None,
    forward: ForwardFn = default_forward,
    rank: int | None = None,
    world_size: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    keep_anchors: bool | None = None,
    handoff_reference: HandoffReference | list[dict[str, Any]] | None = None,
    base: Any = None,
) -> GateReport:
    """Run one gate: a no-grad eval forward over the canary with receipts computed in the hooks.

    Under ``torch.distributed`` it is called on every rank: the ranks first check that they hold the
    same canary (:class:`RankDisagreementError` on every rank otherwise), each measures its share of
    the canary's micro-batches with as many forward calls as every other rank (:func:`micro_batches`),
    and the per-window arrays are gathered, so every rank returns the same report. Expert-parallel
    layers exchange field requests over their expert-parallel group (``atlas_tracking.engine.fields``);
    FSDP2 modules are resharded after the gate. ``rank`` and ``world_size`` may be given to measure
    one shard without a process group (the partial is then only this shard; see
    :func:`measure_partial` and :func:`build_report` to merge shards).

    Without a ``baseline`` the gate keeps the anchor tensors a :class:`~atlas_tracking.Baseline`
    is made of (``keep_anchors`` overrides). With one, drift, paired deltas and lifecycle
    margins are added under ``report.drift``; ``handoff_reference`` (a
    :class:`~atlas_tracking.artifacts.handoff_reference.HandoffReference`, checked against the model like the
    baseline, or its per-layer ``c2`` and ``pi_min``) replaces the baseline as the handoff reference. ``base`` is
    the post-training base (a :class:`~atlas_tracking.Baseline` kept across resumes): the base damage since it and
    the refinement margin's occupancy ratio read against it (the baseline itself when ``base`` is the baseline or None).
    """
    cfg = AtlasConfig.coerce(config)
    layers = layers if layers is not None else find_routed_layers(model)
    check_canary_fits(model, canary)
    declared = handoff_reference if isinstance(handoff_reference, HandoffReference) else None
    check_references(model, canary, layers, baseline, None if base is baseline else base, declared)
    if declared is not None:
        handoff_reference = declared.layers
    if baseline is not None:
        plan = AnchorPlan(positions=baseline.positions, window=canary.window)
    else:
        plan = AnchorPlan.select(canary, cfg.receipts.anchors, cfg.receipts.seed)
    collect = (baseline is None) if keep_anchors is None else keep_anchors
    d_rank, d_world = _dist_rank_world()
    rank = d_rank if rank is None else rank
    world = d_world if world_size is None else world_size
    if world_size is None and d_world > 1:
        check_ranks_agree(canary, cfg, d_world)
    since = base if baseline is not None and base is not baseline else None
    partial = measure_partial(model, canary, cfg, layers, rank, world, forward, progress, plan, collect, baseline,
                              since)
    partials = _gather(partial, d_world) if world_size is None else [partial]
    report = build_report(partials, layers, canary, cfg, model, step, plan, baseline)
    if baseline is not None:
        attach_drift(report, baseline, handoff_reference, base)
    return report


def check_references(model: nn.Module, canary: Canary, layers: list[RoutedLayer], *references: Any) -> None:
    """Each of ``references`` (a :class:`~atlas_tracking.Baseline`, a
    :class:`~atlas_tracking.artifacts.handoff_reference.HandoffReference`, or None) against this model's routed
    layers (their count, family, experts, top-k, width) and the canary: a mismatch is the reference's error naming
    the first difference. Every command and API that reads a reference or a baseline checks it here, before
    anything is measured."""
    described = [lay.describe() for lay in layers]
    for ref in references:
        if ref is not None:
            ref.check_compatible(described, model_class_name(model), canary.fingerprint)


def attach_drift(report: GateReport, baseline: Any, handoff_reference: list[dict[str, Any]] | None = None,
                 base: Any = None) -> None:
    """Add the drift section (and the baseline's per-window arrays, for verify) to a report."""
    base_pw = baseline.manifest["per_window"]
    report.per_window["baseline"] = base_pw
    reference = baseline.manifest["reference"]
    post_base = None
    if base is not None:
        post_base = {"step": base.manifest.get("step"), "reference": base.manifest["reference"],
                     "canary_nll": None if base is baseline else base.manifest["per_window"]["canary_nll"]}
    report.drift = derive_drift(
        report.layers, report.per_window, base_pw, reference, handoff_reference or reference,
        report.canary["n_windows"] * report.canary["window"], report.config["receipts"], report.config["lifecycle"],
        post_base,
    )
    if "kl_base" not in report.per_window:
        report.drift["kl_base_absent"] = baseline.kl_absent or "the forward returned no logits"
    report.drift["baseline"] = {
        "step": baseline.manifest.get("step"),
        "canary_fingerprint": baseline.manifest["canary"]["fingerprint"],
        "model_fingerprint": baseline.manifest["model"]["fingerprint"],
    }
