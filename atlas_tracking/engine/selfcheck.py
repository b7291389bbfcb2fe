"""Adapter self-check: at every gate, a family adapter is compared with the model's own forward.

``verify`` recomputes every receipt from the artifact, which is self-consistent whatever the adapter
read, so a wrong adapter (a zero-centred gain read as plain, a shared expert left out, a post-norm
block read as pre-norm) would pass it silently. On the canary the capture already holds the norm's
input and output, the block's input and output and the router's output; each micro-batch compares
them with what the adapter reconstructs (relative errors ``||ours - model's|| / ||model's||``):

- ``gain``: ``Gamma z`` (the adapter's gain times ``x / rms(x)``; ``Gamma z + beta`` with
  ``z = (x - mean(x)) / std(x)`` for a LayerNorm) against the norm's own output;
- ``block_input``: the norm's output against the MoE block's input (a block whose input is not the
  norm's output does not read that norm: a post-norm block read as pre-norm);
- ``recombination``: ``sum_e w_e u_e(g) + shared(g)`` at a few tokens against the block's output. In
  fused mode (``receipts.fuse_experts``) the block's output is built from the gate's own recombination,
  so this compares only what lies outside the experts call (shared experts and their gates, scalings);
  ``experts_call`` then compares the experts' own forward, at the model's active sets and weights, with
  the same weighted sum of unweighted outputs;
- ``active_set``: the share of tokens whose adapter active set is not the one the model hands its
  experts (fused mode), and at report time the share whose model choice is not a top-k of the adapter's
  selection scores (``rank_violations``).

A layer beyond tolerance makes the gate fail with :class:`AdapterCheckError`, naming the layer and the
mismatch; the measured errors of every layer are kept in the artifact (``layers[i]["selfcheck"]``).
Tolerances are relative and scale with the working precision (``TOLERANCE``); the active-set share
allows rounding ties in reduced precision (``ACTIVE_SET_TOLERANCE``).

    >>> rel_tolerance(torch.float32), rel_tolerance(torch.bfloat16)
    (0.001, 0.02)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from atlas_tracking.adapters.base import Routing
from atlas_tracking.engine.combine import PATHS
from atlas_tracking.engine.kernels import KERNEL_PATHS

CHECKS = ("gain", "block_input", "recombination", "experts_call", "active_set")
TOLERANCE = {torch.float64: 1e-3, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}
"""Relative tolerance by the lowest precision a comparison went through. The worst errors of correct adapters
over every supported family: bf16 3e-3 (fused and unfused); fp32 2e-7, but 3e-4 where an expert's small output
comes from larger intermediates (torchtitan's 0.02-std init) and the sampled tokens meet other matmul blocking
than the forward's. Wrong entries err by 0.1 to 1."""
ACTIVE_SET_TOLERANCE = 0.01
"""Share of tokens whose adapter active set may differ from the model's (rounding ties)."""
SAMPLE_TOKENS = 16
"""Tokens at which the recombination is evaluated, once per gate (expert calls cost; the rest is cheap)."""

_WHY = {
    "gain": "Gamma z (+ beta) (the adapter's norm gain times its normalised state) is not the norm's output: wrong "
            "gain convention (a zero-centred (1 + w) gain read as w?), wrong epsilon, or a LayerNorm read as an "
            "RMSNorm (or the reverse)",
    "block_input": "the MoE block's input is not the norm's output: the block does not read this norm "
                   "(a post-norm block read as pre-norm?)",
    "recombination": "sum_e w_e u_e(g) + shared(g) is not the block's output: a shared expert or its gate left "
                     "out, a scaling the adapter misses, or expert fields that are not what the block sums",
    "experts_call": "the experts' own forward is not the weighted sum of their unweighted outputs "
                    "(inputs scaled by the routing weights?)",
    "active_set": "the adapter's active sets are not the model's: wrong selection scores, bias or group limit",
}


class AdapterCheckError(ValueError):
    """A family adapter disagrees with the model's own forward beyond tolerance (see ``selfcheck``)."""


def rel_tolerance(*dtypes: torch.dtype) -> float:
    """The relative tolerance for a comparison that went through every one of ``dtypes``."""
    return max(TOLERANCE.get(d, TOLERANCE[torch.bfloat16]) for d in dtypes)


def _autocast_dtype(device: torch.device) -> list[torch.dtype]:
    """The dtype the model's forward computed in under autocast (fp32 tensors can hold bf16 products), if on."""
    if not torch.is_autocast_enabled(device.type):
        return []
    return [torch.get_autocast_dtype(device.type)]


def rel_error(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """``||ours - theirs|| / ||theirs||`` in fp32 (0 when both are zero, inf when only ``theirs`` is), a 0-dim tensor
    on their device: read back with the gate's results, not one host synchronisation per comparison.

    >>> float(rel_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 0.0])))
    1.3333333730697632
    """
    ours, theirs = ours.float(), theirs.float()
    return norm_ratio((ours - theirs).norm(), theirs.norm())


def norm_ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` of fp32 norms, elementwise: 0 where both are 0, inf where only ``den`` is.

    >>> norm_ratio(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, 4.0])).tolist()
    [inf, 0.0, 0.5]
    """
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(torch.float32).tiny),
                       torch.where(num > 0, float("inf"), 0.0))


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are views of the same elements in the same layout (so equal, read from the host alone:
    the router's own choice that the model handed its experts unchanged)."""
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr())


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.sort(dim=1).values == b.sort(dim=1).values).all(dim=1)


class SelfCheck:
    """The self-check of one routed layer during one gate; results go to its accumulator, per window."""

    def __init__(self, layer: Any, acc: Any):
        self.layer = layer
        self.acc = acc
        acc.arrays["selfcheck"] = torch.full((acc.n_windows, len(CHECKS)), float("nan"), device=acc.device)
        acc.arrays["selfcheck_tol"] = torch.full((acc.n_windows,), float("nan"), device=acc.device)
        self._call: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def experts_call(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> None:
        """Keep what the model handed its experts in this micro-batch (fused mode)."""
        self._call = (hidden, index, weights)

    def sample_groups(self, g: torch.Tensor, active: torch.Tensor,
                      handed: tuple[torch.Tensor, torch.Tensor] | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (rows, experts) whose fields the expert checks read, for the micro-batch that holds the canary's
        first window (window-major ``g`` and ``active``): its first ``SAMPLE_TOKENS`` tokens at the adapter's
        active sets and, in fused mode, at the experts the model handed them (``handed``: its rows and indices).
        The capture evaluates them in its competitors' call (or its active set's, where the competitors are pooled)
        and hands the fields to :meth:`observe`."""
        n = min(SAMPLE_TOKENS, self.acc.window)
        return [(g[:n], active[:n]), *(() if handed is None else ((handed[0][:n], handed[1][:n]),))]

    def _sample(self, n_windows: int, active: torch.Tensor) -> torch.Tensor:
        """Native rows of the first ``SAMPLE_TOKENS`` positions of the micro-batch's first window (the same
        tokens whatever the batching, and those of :meth:`sample_groups`)."""
        pos = torch.arange(min(SAMPLE_TOKENS, len(active) // n_windows), device=active.device)
        return pos * n_windows if self.layer.sequence_first else pos

    def _per_window(self, ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
        """Relative errors ``[windows]`` of two ``[B, L, d]`` (sequence-first: ``[L, B, d]``) tensors."""
        dims = (0, 2) if self.layer.sequence_first else (1, 2)
        ours, theirs = ours.float(), theirs.float()
        return norm_ratio((ours - theirs).norm(dim=dims), theirs.norm(dim=dims))

    @torch.no_grad()
    def observe(self, x: torch.Tensor, g: torch.Tensor, block_input: Any, routing: Routing,
                out: torch.Tensor, windows: tuple[int, int], size: int, sampled: tuple[torch.Tensor, ...] = ()) -> None:
        """Compare one micro-batch's norm, block input, output and routing with the adapter's reading.

        The cheap comparisons are kept per window (independent of how the canary is batched or sharded).
        Those that evaluate experts run once per gate, at the first tokens of the canary's first window: their
        fields (``sampled``, of :meth:`sample_groups`) ride in the capture's call for the competitors (with the active
        set where the competitors are pooled), and in fused mode the experts' own forward runs once on those tokens.
        A structural mismatch shows at any token, and the gate stays one forward pass.
        """
        layer, call = self.layer, self._call
        self._call = None
        w0, w1 = windows
        n_windows, d = size, g.shape[-1]
        errs = torch.full((n_windows, len(CHECKS)), float("nan"), device=self.acc.device)
        col = {name: j for j, name in enumerate(CHECKS)}
        errs[:, col["gain"]] = self._per_window(layer.gain(layer.normalize(x)), g)
        same_size = isinstance(block_input, torch.Tensor) and block_input.numel() == g.numel()
        if not same_size:
            errs[:, col["block_input"]] = float("inf")
        elif same_tensor(block_input, g):  # the block reads the norm's own output: no error to measure
            errs[:, col["block_input"]] = 0.0
        else:
            errs[:, col["block_input"]] = self._per_window(block_input.reshape(g.shape), g)
        g2, out2 = g.reshape(-1, d), out.reshape(-1, d)
        if call is not None:
            handed = call[1].reshape(len(g2), -1).long()
            if same_tensor(handed, routing.active):  # the router's own choice, handed on unchanged
                errs[:, col["active_set"]] = 0.0
            else:
                shape = (-1, n_windows) if layer.sequence_first else (n_windows, -1)
                mismatch = (~_same_sets(routing.active, handed)).view(shape).float()
                errs[:, col["active_set"]] = mismatch.mean(dim=0 if layer.sequence_first else 1)
        dtypes = [g.dtype, out.dtype, *_autocast_dtype(g.device)]
        if sampled:
            errors: dict[str, torch.Tensor] = {}
            rows = self._sample(n_windows, routing.active)
            dtypes.append(self._expert_checks(errors, rows, g2, out2, routing, call, sampled))
            for name, error in errors.items():
                errs[0, col[name]] = error
        self.acc.arrays["selfcheck"][w0:w1] = errs[: w1 - w0]  # padding windows come last
        self.acc.arrays["selfcheck_tol"][w0:w1] = rel_tolerance(*dtypes)

    def _expert_checks(self, errors: dict[str, torch.Tensor], rows: torch.Tensor, g2: torch.Tensor, out2: torch.Tensor,
                       routing: Routing, call: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                       sampled: tuple[torch.Tensor, ...]) -> torch.dtype:
        """``recombination`` (and ``experts_call`` in fused mode) at ``rows`` from the ``sampled`` fields;
        returns the fields' dtype."""
        layer = self.layer
        g_s = g2.index_select(0, rows)
        recon = (routing.weights.index_select(0, rows).float().unsqueeze(-1) * sampled[0].float()).sum(1)
        shared = layer.shared_output(g_s)
        if shared is not None:
            recon = recon + shared.float().reshape(len(rows), -1)
        errors["recombination"] = rel_error(recon, out2.index_select(0, rows))
        if call is not None:
            hidden, index, weights = (t.reshape(len(g2), -1).index_select(0, rows) for t in call)
            ours = (weights.float().unsqueeze(-1) * sampled[1].float()).sum(1)
            errors["experts_call"] = rel_error(ours, layer.experts_forward(hidden, index, weights))
        return sampled[0].dtype


def fallback_reason(kernels: np.ndarray, owned: list[np.ndarray], fallbacks: list[str | None]) -> str | None:
    """Why a layer's field arithmetic ran eagerly where a compile had failed, from every process of the gate:
    ``kernels`` the layer's merged per-window paths (codes of ``engine/kernels.py``'s ``KERNEL_PATHS``), ``owned``
    each process's windows, ``fallbacks`` each process's reason (None where none failed). One process: its reason;
    several: ``rank r: reason`` for each process whose windows ran eagerly after a failure, joined by ``; ``. None
    where no such process is.

    >>> paths, owned = np.array([0, 0, 1, 1]), [np.array([0, 1]), np.array([2, 3])]   # rank 0 eager, rank 1 compiled
    >>> fallback_reason(paths, owned, ["RuntimeError: no compiler", None])
    'rank 0: RuntimeError: no compiler'
    >>> fallback_reason(paths, owned, [None, "RuntimeError: no compiler"]) is None    # rank 1 compiled all the same
    True
    >>> fallback_reason(paths[:2], owned[:1], ["RuntimeError: no compiler"])
    'RuntimeError: no compiler'
    """
    eager = KERNEL_PATHS.index("eager")
    ran = [(rank, why) for rank, (own, why) in enumerate(zip(owned, fallbacks))
           if why is not None and np.any(kernels[own] == eager)]
    if not ran:
        return None
    return ran[0][1] if len(fallbacks) == 1 else "; ".join(f"rank {rank}: {why}" for rank, why in ran)


def layer_summary(host: dict[str, Any], owned: list[np.ndarray], fallbacks: list[str | None]) -> dict[str, Any]:
    """One layer's worst error per check over the canary (None where not measured), the tolerance, the
    share of tokens whose model choice is not a top-k of the adapter's scores, how the layer's output
    came about in the gate (``layer_output``: the paths of ``engine/combine.py`` joined by ``+``) and how its field
    arithmetic ran (``kernels``: the paths of ``engine/kernels.py`` joined by ``+``, with ``kernels_fallback``,
    :func:`fallback_reason`, where a process computed it eagerly because a compile failed). ``owned`` and
    ``fallbacks``: each process's windows and compile failure (a gate's partials carry them)."""
    errs = np.asarray(host["selfcheck"], dtype=np.float64)
    summary: dict[str, Any] = {}
    for j, name in enumerate(CHECKS):
        col = errs[:, j][~np.isnan(errs[:, j])]
        summary[name] = float(col.max()) if col.size else None
    tol = np.asarray(host["selfcheck_tol"], dtype=np.float64)
    summary["tolerance"] = float(np.nanmax(tol)) if np.isfinite(tol).any() else None
    summary["rank_violation_share"] = float(np.sum(host["rank_violations"])) / max(1, np.asarray(host["margin"]).size)
    summary["layer_output"] = "+".join(PATHS[c] for c in np.unique(np.asarray(host["layer_output"])))
    kernels = np.asarray(host["kernels"])
    summary["kernels"] = "+".join(KERNEL_PATHS[c] for c in np.unique(kernels))
    reason = fallback_reason(kernels, owned, fallbacks)
    if reason is not None:
        summary["kernels_fallback"] = reason
    return summary


def check_layers(layers: list[Any], hosts: list[dict[str, Any]], owned: list[np.ndarray],
                 fallbacks: list[str | None]) -> list[dict[str, Any]]:
    """Every layer's self-check summary (``owned``, ``fallbacks``: as :func:`layer_summary`'s); raises
    :class:`AdapterCheckError` naming each layer beyond tolerance."""
    summaries, problems = [], []
    for layer, host in zip(layers, hosts):
        s = layer_summary(host, owned, fallbacks)
        summaries.append(s)
        tol = s["tolerance"] if s["tolerance"] is not None else TOLERANCE[torch.float32]
        for name in CHECKS:
            value = s[name]
            limit = ACTIVE_SET_TOLERANCE if name == "active_set" else tol
            if value is not None and not value <= limit:
                problems.append(f"{layer.name} ({layer.family}): {_WHY[name]} [{name}: {value:.3g}, tolerance {limit:g}]")
        if s["rank_violation_share"] > ACTIVE_SET_TOLERANCE:
            problems.append(f"{layer.name} ({layer.family}): {_WHY['active_set']} [{s['rank_violation_share']:.2%} of "
                            f"tokens' model choice is not a top-k of the adapter's scores, tolerance "
                            f"{ACTIVE_SET_TOLERANCE:.0%}]")
    if problems:
        raise AdapterCheckError("adapter self-check failed: " + "; ".join(problems))
    return summaries
