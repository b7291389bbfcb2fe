"""Base-domain damage: forward KL(base || now) on the canary's predicted tokens.

A baseline keeps, for every predicted token (window positions 0..T-2 predicting the next
token), the base model's top-K log-probabilities ``log p_S``, their vocabulary indices ``S``
and the log of the remaining base mass ``log r`` (``r = 1 - sum_S p``). A later gate compares
its own distribution ``q`` on the same tokens through the coarse-grained KL

    sum_{v in S} p_v (log p_v - log q_v) + r (log r - log(1 - sum_{v in S} q_v)),

the KL between the two distributions once the vocabulary outside ``S`` is merged into one bin.
By the log-sum inequality it is a lower bound of the full-vocabulary KL, equal to it when
``r = 0`` (``K`` = vocabulary size). Both ``log r`` and ``log(1 - sum_S q)`` are the logsumexp
of the log-probabilities outside ``S`` (never ``log(1 - exp(.))`` of a sum close to one), and
base and current log-probabilities come from the same :func:`log_probs` path, so identical
logits give exactly 0.

Everything runs on the logits' device in fp32, ``TOKEN_CHUNK_ELEMENTS`` logits at a time, so
memory beyond the forward's own logits stays at a few ``[chunk, vocab]`` fp32 buffers
(64 MiB each), whatever the micro-batch.

Example:
    >>> import torch
    >>> _ = torch.manual_seed(0)
    >>> base, now = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    >>> logp, index, log_rest = base_topk(base, k=4)
    >>> logp.shape, index.dtype, log_rest.shape
    (torch.Size([2, 4, 4]), torch.int32, torch.Size([2, 4]))
    >>> s, n = window_kl(base, logp, index, log_rest)      # identical logits
    >>> s.tolist(), n.tolist()
    ([0.0, 0.0], [4, 4])
    >>> bounded = window_kl(now, logp, index, log_rest)[0]
    >>> exact = window_kl_exact(base, now)[0]
    >>> bool((bounded > 0).all() and (bounded <= exact + 1e-6).all())
    True
    >>> full = base_topk(base, k=11)                        # K = vocabulary: r = 0, the exact KL
    >>> torch.allclose(window_kl(now, *full)[0], exact, atol=1e-5)
    True
"""

from __future__ import annotations

import torch

TOKEN_CHUNK_ELEMENTS = 1 << 24
"""fp32 logits handled at once (64 MiB): ``max(1, 2**24 // vocab)`` predicted tokens per chunk."""


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last axis: the one path both base and current log-probabilities take."""
    return torch.log_softmax(logits.float(), dim=-1)


def _log_rest(logq: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log of the mass outside ``index`` (``-inf`` when ``index`` covers the vocabulary), from the tail itself."""
    return logq.scatter(-1, index.long(), float("-inf")).logsumexp(dim=-1)


def _chunks(n_tokens: int, vocab: int) -> list[slice]:
    step = max(1, TOKEN_CHUNK_ELEMENTS // max(1, vocab))
    return [slice(i, min(i + step, n_tokens)) for i in range(0, n_tokens, step)]


def base_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The base side of the KL for logits ``[B, T, V]``: per predicted token (positions 0..T-2)
    the top-``k`` log-probabilities ``[B, T-1, k]`` (fp32), their indices (int32) and ``log r``
    ``[B, T-1]`` (fp32), on the logits' device. ``k`` is capped at the vocabulary size."""
    b, t, v = logits.shape
    k = min(k, v)
    flat = logits[:, :-1].reshape(-1, v)
    logp = torch.empty(flat.shape[0], k, dtype=torch.float32, device=logits.device)
    index = torch.empty(flat.shape[0], k, dtype=torch.int32, device=logits.device)
    log_rest = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for sl in _chunks(flat.shape[0], v):
        logq = log_probs(flat[sl])
        top = logq.topk(k, dim=-1)
        logp[sl], index[sl] = top.values, top.indices.to(torch.int32)
        log_rest[sl] = _log_rest(logq, top.indices)
    return logp.view(b, t - 1, k), index.view(b, t - 1, k), log_rest.view(b, t - 1)


def token_kl(logq: torch.Tensor, logp: torch.Tensor, index: torch.Tensor, log_rest: torch.Tensor) -> torch.Tensor:
    """Coarse-grained KL(base || now) per token from current log-probabilities ``logq [N, V]`` and
    the base's ``logp [N, K]``, ``index [N, K]``, ``log_rest [N]``; a token with ``r = 0`` has no tail term."""
    terms = logp.exp() * (logp - logq.gather(-1, index.long()))
    head = torch.where(torch.isneginf(logp), torch.zeros_like(terms), terms).sum(dim=-1)
    tail = log_rest.exp() * (log_rest - _log_rest(logq, index))
    return head + torch.where(torch.isneginf(log_rest), torch.zeros_like(tail), tail)


def window_kl(
    logits: torch.Tensor, logp: torch.Tensor, index: torch.Tensor, log_rest: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-window sum of the coarse-grained KL over the predicted tokens of ``logits [B, T, V]``
    against the base's ``[B, T-1, K]`` top-K (fp32 on the logits' device), and the token counts."""
    b, t, v = logits.shape
    flat = logits[:, :-1].reshape(-1, v)
    device = logits.device
    logp, index, log_rest = logp.to(device).reshape(-1, logp.shape[-1]), index.to(device).reshape(
        -1, index.shape[-1]), log_rest.to(device).reshape(-1)
    kl = torch.empty(flat.shape[0], dtype=torch.float32, device=device)
    for sl in _chunks(flat.shape[0], v):
        kl[sl] = token_kl(log_probs(flat[sl]), logp[sl], index[sl], log_rest[sl])
    counts = torch.full((b,), t - 1, dtype=torch.int64, device=device)
    return kl.view(b, t - 1).sum(dim=1), counts


def window_kl_exact(base_logits: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-window sum of the full-vocabulary KL(base || now) over the predicted tokens, and the counts."""
    b, t, v = logits.shape
    base_flat, flat = base_logits[:, :-1].reshape(-1, v), logits[:, :-1].reshape(-1, v)
    kl = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for sl in _chunks(flat.shape[0], v):
        logp, logq = log_probs(base_flat[sl].to(logits.device)), log_probs(flat[sl])
        kl[sl] = torch.where(torch.isneginf(logp), torch.zeros_like(logp), logp.exp() * (logp - logq)).sum(dim=-1)
    return kl.view(b, t - 1).sum(dim=1), torch.full((b,), t - 1, dtype=torch.int64, device=logits.device)
