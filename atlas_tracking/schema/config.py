"""One validated configuration for receipts, lifecycle margins, the gate policy and alerts.

Every key is checked: an unknown key or a value of the wrong type is an error that
names the key and what is allowed. YAML is read with ``yaml.safe_load`` only.

Example:
    >>> cfg = AtlasConfig.from_dict({"receipts": {"boundary_q": 0.2}})
    >>> cfg.receipts.boundary_q
    0.2
    >>> AtlasConfig.from_dict({"receipts": {"boundary_qq": 0.2}})
    Traceback (most recent call last):
    ...
    atlas_tracking.schema.config.ConfigError: unknown key 'receipts.boundary_qq'; allowed keys: ...
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A configuration key is unknown, missing or of the wrong type."""


@dataclass
class ReceiptsConfig:
    """How receipts are measured (docs/receipts.md)."""

    boundary_q: float = 0.1
    """Fraction of each window's tokens (smallest set margin) that forms the boundary set B_w."""
    boundary_deltas: list[float] = field(default_factory=lambda: [0.001, 0.01, 0.1])
    """Margin thresholds delta (selection-score units) for ``boundary_mass@delta``."""
    beta_adj: float = 1.0
    """Adjacency inverse temperature in the C2 pair weights exp(-beta_adj |s_e - s_e'|)."""
    beta_pi: float = 1000.0
    """Inverse temperature of the soft minimum in ``pi_tail_smooth``."""
    eps_kappa: float = 1e-8
    """Stabiliser in kappa's denominator."""
    eps_d: float = 1e-8
    """Stabiliser in the redundancy distance D(a, b)."""
    n_bootstrap: int = 1000
    """Window-bootstrap resamples."""
    ci_level: float = 0.95
    """Two-sided percentile confidence level."""
    seed: int = 0
    """Seed for the bootstrap and the random-e2 kill-shot."""
    batch_windows: int = 8
    """Canary windows per forward micro-batch (also the sharding unit over ranks)."""
    token_chunk: int | None = None
    """Tokens per call of the experts when evaluating fields. None (default): a call holds at most half
    the forward's own (token, expert) rows of the micro-batch (a call materialises its input and output
    rows), so a gate's peak memory stays near the forward's; narrow models (rows x d within 16 MiB of
    fp32) make one call; and no more rows than fit in a quarter of the memory free when the gate starts
    (docs/receipts.md#memory). A larger value makes fewer, bigger calls."""
    fuse_experts: bool = True
    """Evaluate the active experts once, inside the model's own forward, and hand back the layer's output
    built from them wherever that is the model's own output bit for bit (checked at a layer's first call under
    each arithmetic, once per process; otherwise the experts' own forward runs as well). False leaves the
    forward untouched and evaluates the fields a second time in the block's hook (docs/receipts.md#precision)."""
    kernels: Literal["auto", "compiled", "eager"] = "auto"
    """How the per-token field arithmetic runs: "compiled" (``torch.compile``, once per process), "eager", or
    "auto" (default): compiled on a CUDA device where triton is importable, eager elsewhere (on a CPU a compile
    costs seconds per process and needs a C++ compiler). A compile that fails falls back to eager for the rest
    of the process, never failing a gate (docs/receipts.md#field-kernels)."""
    anchors: int = 1024
    """Anchor tokens kept in a baseline for drift receipts."""
    baseline_fields_dtype: Literal["float32", "float16", "bfloat16"] | None = None
    """Storage dtype of the base expert fields ``u0`` in a baseline artifact. None (default): chosen with the
    anchors' storage form from ``baseline_budget_bytes``. "float32" keeps every anchor tensor exact; "float16"
    or "bfloat16" stores ``u0`` in that dtype with ``z0`` and ``p0`` in float16 and ``g0`` recomputed
    (docs/receipts.md#compact-anchors)."""
    anchor_sketch_dim: int | None = None
    """Dimension m of the fixed random projection the base fields ``u0`` are stored in. None (default): chosen
    from ``baseline_budget_bytes``; 0: no projection; m >= 1: this m (docs/receipts.md#compact-anchors)."""
    baseline_budget_bytes: int | None = 1_000_000_000
    """Most bytes one baseline's anchor tensors may take: the most exact storage form that fits is chosen
    before collecting (exact float32, half precision, then projected fields of the largest power-of-two
    dimension). None: no limit (exact float32). A layout whose most compact form does not fit is a ConfigError."""
    kl_top_k: int = 32
    """Base log-probabilities kept per canary predicted token in a baseline (the top-K and the remaining
    mass) for ``kl_base``, the bounded forward KL(base || now) each gate reports: K x 8 + 4 bytes per token
    (fp32 log-probabilities, int32 indices, fp32 log of the rest). 0 keeps none (no ``kl_base``)."""
    content_quantile: float = 0.9
    """Quantile over the active set in ``content_drift``."""
    terminal_band: int = 3
    """Routed layers before the terminal one whose mean ``ov_cf`` the terminal jump is taken against
    (``ov_cf_terminal_jump``; fewer when the model has fewer)."""
    progress: bool = True
    """Print progress for long canaries (to stderr)."""

    def _validate(self, prefix: str) -> None:
        _check_range(prefix, "boundary_q", self.boundary_q, 0.0, 1.0, lo_open=True)
        _check_range(prefix, "ci_level", self.ci_level, 0.0, 1.0, lo_open=True)
        _check_range(prefix, "content_quantile", self.content_quantile, 0.0, 1.0)
        for name in ("n_bootstrap", "batch_windows", "token_chunk", "anchors", "terminal_band"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"'{prefix}{name}' must be >= 1, got {getattr(self, name)!r}")
        if isinstance(self.kl_top_k, bool) or not isinstance(self.kl_top_k, int) or self.kl_top_k < 0:
            raise ConfigError(f"'{prefix}kl_top_k' must be an integer >= 0 (0: no kl_base), got {self.kl_top_k!r}")
        if any(d <= 0 for d in self.boundary_deltas):
            raise ConfigError(f"'{prefix}boundary_deltas' must be positive numbers, got {self.boundary_deltas!r}")
        if self.anchor_sketch_dim is not None and self.anchor_sketch_dim < 0:
            raise ConfigError(f"'{prefix}anchor_sketch_dim' must be >= 0 (0: no projection) or null, "
                              f"got {self.anchor_sketch_dim!r}")
        if self.anchor_sketch_dim and self.baseline_fields_dtype == "float32":
            raise ConfigError(f"'{prefix}anchor_sketch_dim' {self.anchor_sketch_dim} needs a half-precision "
                              f"'{prefix}baseline_fields_dtype' (float16, bfloat16 or null), got float32")
        if self.baseline_budget_bytes is not None and self.baseline_budget_bytes < 1:
            raise ConfigError(f"'{prefix}baseline_budget_bytes' must be >= 1 or null, got {self.baseline_budget_bytes!r}")


@dataclass
class LifecycleConfig:
    """Handoff and refinement margins (docs/receipts.md#lifecycle-margins)."""

    protected_layers: Literal["mid", "all", "auto"] | list[int] = "mid"
    """"mid" (middle half of the routed layers), "all", routed-layer ordinals, or "auto": chosen once per run
    from its recorded gates and then held (docs/policy.md#protected-layers;
    :mod:`atlas_tracking.decisions.protection`): among the layers of the mid band ``auto_band``, those whose
    experts stay alive (``auto_persistence_floor``) with the worst median C2 loss, half the band rounded up;
    "mid" until the evidence exists (the handoff's pretraining gates, or ``auto_min_gates`` post-baseline
    gates). Each gate record names the set and its source (``protected_layers``, ``protected_source``); a
    change of the set in a run is recorded as ``protected_change``."""
    auto_min_gates: int = 2
    """protected_layers auto: evidence gates (post-baseline, or pretraining gates at the handoff) needed
    before the set is chosen."""
    auto_band: list[float] = field(default_factory=lambda: [0.25, 0.75])
    """protected_layers auto: the mid band the candidates come from, ``[lo, hi]`` as fractions of routed-layer
    depth (routed layer i of n at depth i / (n - 1)): ordinals ceil(lo (n - 1)) to floor(hi (n - 1)), 7-19 of
    27 routed layers; with no layer inside, the layers nearest the band's middle."""
    auto_persistence_floor: float = 0.5
    """protected_layers auto: a layer counts as persistent (kept specialized experts) when the median
    fraction of its experts receiving canary tokens is at least this; persistent layers rank first."""
    lam1: float = 1.0
    lam2: float = 0.1
    mu1: float = 1.0
    mu2: float = 1.0
    mu3: float = 0.1
    tau: float = 0.25
    handoff_reference: str | None = None
    """A declared healthy reference for the handoff margin: a receipts artifact (``receipts/step_N.json`` or ``.safetensors``) or a
    baseline directory of a healthy checkpoint on the same routed layers and canary (an earlier model of the
    family), or "gate:N", this run's own gate at step N (pinned: read once that gate has run). Handoff
    readiness needs it; without it readiness rests on
    stability only and a gate is never "ready" (docs/policy.md#handoff-readiness)."""

    def _validate(self, prefix: str) -> None:
        if self.auto_min_gates < 1:
            raise ConfigError(f"'{prefix}auto_min_gates' must be >= 1, got {self.auto_min_gates!r}")
        if len(self.auto_band) != 2 or not 0.0 <= self.auto_band[0] < self.auto_band[1] <= 1.0:
            raise ConfigError(f"'{prefix}auto_band' must be [lo, hi] with 0 <= lo < hi <= 1 (fractions of "
                              f"routed-layer depth), got {self.auto_band!r}")
        _check_range(prefix, "auto_persistence_floor", self.auto_persistence_floor, 0.0, 1.0)


@dataclass
class PolicyConfig:
    """Lifecycle phase and tolerances of the gate reading (docs/policy.md#lifecycle-phases)."""

    phase: Literal["auto", "pretraining", "post_training"] = "auto"
    """How gates are read. "pretraining": the atlas is forming; the reference rolls forward gate to gate,
    preservation verdicts and escalation are off, occupancy collapse still alerts, and each gate reports
    handoff readiness. "post_training": preservation against the baseline with staged escalation. "auto":
    decided at the run's first gate (pretraining when its canary NLL shows a freshly initialised model, see
    fresh_nll_ratio) and kept, through resumes, in the checkpointed state. An explicit phase always wins:
    resuming a pretraining run with "post_training" is the handoff (the resume gate is its baseline)."""
    fresh_nll_ratio: float = 0.9
    """phase auto: a first gate whose canary NLL is at least this fraction of ln(vocab_size), the NLL of a
    uniform guess, is a freshly initialised model (pretraining); a lower NLL is a loaded, trained model."""
    n_stable: int = 2
    """Pretraining: consecutive gates whose gate-to-gate C2 and occupancy changes stay inside the
    tolerances (or whose paired CIs cover 0) before the atlas counts as a stable baseline for handoff."""
    collapse_dead_fraction: float = 0.75
    """Occupancy collapse: a routed layer on which more than this fraction of the experts receive no canary
    token."""
    collapse_effective_experts: float = 2.0
    """Occupancy collapse: a routed layer whose effective expert count exp(router_entropy) falls below this
    many times its top-k (routing concentrated on about as many experts as a token selects)."""
    ready_dead_fraction: float = 0.25
    """Handoff readiness: no routed layer may have more than this fraction of its experts dead (stricter than the
    collapse floor: an atlas around many dead experts is not ready to hand off)."""
    ready_effective_fraction: float = 0.5
    """Handoff readiness: every routed layer's effective expert count exp(router_entropy) must be at least this
    fraction of its experts."""
    damage_kl_tol: float = 0.05
    """Base-domain damage predicate: the bounded KL(base || now) since the post-training base (nats per canary
    token) above which, with its CI excluding 0, the base domain counts as damaged."""
    damage_nll_tol: float = 0.05
    """Base-domain damage predicate: the canary NLL rise since the post-training base (nats per token) above
    which, with its CI excluding 0, the base domain counts as damaged."""
    c2_tol: float = 0.005
    """C2 moves smaller than this (absolute) are 'stable' (against the baseline and the previous gate)."""
    dead_tol: float = 0.0
    """Dead experts may rise by at most this many (mean over layers) before occupancy 'degrades'."""
    entropy_tol: float = 0.05
    """Min router entropy may fall by at most this many nats."""
    cv_tol: float = 5.0
    """Mean load CV (x100, as in the paper's tables) may rise by at most this much."""
    loss_tol: float = 0.0
    """The objective must improve (a loss fall, a maximised objective rise) by more than this to count as
    'improving'."""
    loss_window: int = 2
    """The objective is 'improving' when better than its value this many gates earlier (or the earliest since the
    baseline) by more than loss_tol, and not worse than the previous gate's by more than loss_tol."""
    n_recover: int = 2
    """Consecutive jointly recovering gates needed to return to 'clean'."""
    use_ci: bool = True
    """When paired CIs are present, C2 'worsens' only if the CI of the change excludes zero."""

    def _validate(self, prefix: str) -> None:
        _check_range(prefix, "fresh_nll_ratio", self.fresh_nll_ratio, 0.0, 1.0, lo_open=True)
        _check_range(prefix, "collapse_dead_fraction", self.collapse_dead_fraction, 0.0, 1.0)
        _check_range(prefix, "ready_dead_fraction", self.ready_dead_fraction, 0.0, 1.0)
        _check_range(prefix, "ready_effective_fraction", self.ready_effective_fraction, 0.0, 1.0)
        if self.collapse_effective_experts < 0:
            raise ConfigError(f"'{prefix}collapse_effective_experts' must be >= 0, got {self.collapse_effective_experts!r}")
        for name in ("n_recover", "loss_window", "n_stable"):
            if getattr(self, name) < 1:
                raise ConfigError(f"'{prefix}{name}' must be >= 1, got {getattr(self, name)!r}")
        for name in ("c2_tol", "dead_tol", "entropy_tol", "cv_tol", "loss_tol", "damage_kl_tol", "damage_nll_tol"):
            if getattr(self, name) < 0:
                raise ConfigError(f"'{prefix}{name}' must be >= 0, got {getattr(self, name)!r}")


DIRECTIONS = ("minimize", "maximize")
"""The directions an objective improves in."""
MAXIMIZED_WORDS = ("reward", "rewards", "accuracy", "acc")
"""Words of a metric's name that make it maximised by default (:func:`default_direction`)."""


def default_direction(metric: str | None) -> str:
    """The direction a metric improves in when none is configured: ``maximize`` when a word of its name (split at
    anything but letters and digits) is in :data:`MAXIMIZED_WORDS` and none is ``loss``; otherwise ``minimize``.

    >>> [default_direction(m) for m in ("eval_reward", "eval_rewards/format/mean", "val/acc", "eval_loss", None)]
    ['maximize', 'maximize', 'maximize', 'minimize', 'minimize']
    >>> default_direction("reward_loss")
    'minimize'
    """
    words = set(re.split(r"[^a-z0-9]+", (metric or "").lower()))
    return "maximize" if words & set(MAXIMIZED_WORDS) and "loss" not in words else "minimize"


@dataclass
class ObjectiveConfig:
    """The gate's objective: the logged metric a gate reads as its ``loss`` and the direction it improves in
    (docs/policy.md#the-objective). The loss trend, the judge's scalar-quality check and the sentences read it in
    its direction."""

    metric: str | None = None
    """The metric a training framework's callback reads (the callbacks' ``loss_key=`` names it too). None: the
    integration's default (``eval_loss``; ``eval_reward`` under TRL's GRPOTrainer and RLOOTrainer; Lightning's
    ``val_loss``, ...). A named metric a gate's evaluation did not log fails that gate with an error naming the
    metrics it did log."""
    direction: Literal["minimize", "maximize"] | None = None
    """How the objective improves. None: the metric's default, ``maximize`` for a name holding the word reward,
    rewards, accuracy or acc (and not loss), else ``minimize``. A plain loop's ``gate.run(step, loss=...)`` reads
    its value in this direction."""

    def _validate(self, prefix: str) -> None:
        if self.metric is not None and not self.metric.strip():
            raise ConfigError(f"'{prefix}metric' must name a metric or be null (the integration's default), "
                              f"got {self.metric!r}")

    def direction_for(self, metric: str | None) -> str:
        """The direction of the objective read from ``metric`` (the configured one, else the metric's default).

        >>> ObjectiveConfig().direction_for("eval_reward"), ObjectiveConfig(direction="minimize").direction_for("eval_reward")
        ('maximize', 'minimize')
        """
        return self.direction or default_direction(metric or self.metric)


@dataclass
class AlertRule:
    """A threshold rule on a receipt, e.g. ``dead_experts > 64`` on any protected layer."""

    name: str = ""
    metric: str = ""
    op: Literal[">", ">=", "<", "<=", "=="] = ">"
    value: float = 0.0
    scope: Literal["summary", "any_layer", "any_protected_layer", "all_layers"] = "summary"
    level: Literal["INFO", "WARN", "ERROR"] = "WARN"
    min_interval_steps: int = 0
    """Minimum number of training steps between two firings of this rule."""

    def _validate(self, prefix: str) -> None:
        if not self.metric:
            raise ConfigError(f"'{prefix}metric' is required for an alert rule")
        if not self.name:
            self.name = f"{self.metric} {self.op} {self.value:g} ({self.scope})"


@dataclass
class AlertsConfig:
    """Which events become alerts. Stage alerts are built in; ``rules`` adds thresholds."""

    on_revoked: Literal["INFO", "WARN", "ERROR", "off"] = "WARN"
    on_intervene: Literal["INFO", "WARN", "ERROR", "off"] = "ERROR"
    on_resume_baseline: Literal["INFO", "WARN", "ERROR", "off"] = "INFO"
    on_recovered: Literal["INFO", "WARN", "ERROR", "off"] = "INFO"
    on_canary_change: Literal["INFO", "WARN", "ERROR", "off"] = "INFO"
    """A resume with another canary: the re-baseline alert names both fingerprints."""
    on_collapse: Literal["INFO", "WARN", "ERROR", "off"] = "WARN"
    """Pretraining: a gate enters stage ``collapse`` (occupancy collapse on a routed layer)."""
    on_handoff_ready: Literal["INFO", "WARN", "ERROR", "off"] = "INFO"
    """Pretraining: a gate enters stage ``ready`` (handoff readiness holds)."""
    on_rewrite: Literal["INFO", "WARN", "ERROR", "off"] = "WARN"
    """Post-training: the protected-atlas rewrite predicate turns ``fail`` (refinement margin below 0, CI too)."""
    on_base_damage: Literal["INFO", "WARN", "ERROR", "off"] = "WARN"
    """Post-training: the base-domain damage predicate turns ``fail`` (damage since the base beyond tolerance)."""
    wait_duration_s: float = 300.0
    """Minimum seconds between two identical alerts delivered by a tracker."""
    rules: list[AlertRule] = field(default_factory=list)
    webhook_url_env: str = "ATLAS_WEBHOOK_URL"
    """Environment variable holding a webhook URL for alert JSON (never logged)."""
    webhook_url: str = ""
    """A webhook URL given directly (never logged); the environment variable wins when set."""


@dataclass
class GateConfig:
    """When gates run and what they keep."""

    every_n_validations: int = 1
    baseline_at_start: bool = True
    """Measure the baseline when training starts (the paper's step-0 baseline), before any update."""
    checkpoint_on_green: bool = False
    keep_green_checkpoints: int = 3
    log_per_layer: bool = True
    param_drift: bool = True
    """Parameter drift per module group against the baseline's parameters (a host copy of the parameters
    each process holds; see :mod:`atlas_tracking.engine.param_reference`). False: no copy, no ``param_drift``."""
    param_drift_budget_bytes: int | None = 8 << 30
    """The most host bytes one process's parameter-drift reference may take (8 GiB; None: no bound). Beyond it
    every n-th element of each tensor is kept and the drift is an estimate, which the record says
    (``param_drift.reference``; docs/receipts.md#parameter-drift)."""
    existing_record: Literal["new_dir", "refuse"] = "new_dir"
    """A fresh run whose out_dir holds another run's record: write to a new directory beside it
    (``<out_dir>-2``, ...; a warning names it) or refuse with an error. Never appended to."""
    delivery_wait_s: float = 10.0
    """At the end of training, how long to wait at most for the trackers to receive the gates still queued
    (tracker calls run off the training thread; a call already running this long is not waited for). Gates
    not delivered by then stay in the local record and are reported per tracker (docs/trackers.md)."""
    collective_timeout_s: float = 300.0
    """Under ``torch.distributed``, how long every collective a gate makes waits at most for the other processes
    (5 minutes, well under the process group's own 30 minutes under gloo): before each one the processes meet
    at a monitored barrier on a side gloo group, and a process that does not arrive in time (stopped, or gone)
    fails the gate on every process that can still speak with an ERROR naming it and the gate's step
    (docs/distributed.md#a-stalled-or-dead-rank)."""
    keep_baselines: int = 2
    """Retention: how many of the history's latest baselines stay on disk (2: the current reference and the one
    before it). The post-training base, a handoff reference in the run directory and pinned steps always stay
    (docs/record.md#retention)."""
    pin_baselines: list[int] = field(default_factory=list)
    """Steps whose baselines retention never removes (``atlas-tracking pin RUN_DIR STEP`` adds more)."""
    keep_receipts: int | None = None
    """Retention of receipts artifacts: keep those of the history's last N gates (None: every one).
    ``gates.jsonl`` is never pruned, and each record keeps its artifact's sha256."""
    receipts_format: Literal["auto", "json", "safetensors"] = "auto"
    """The form of each gate's receipts artifact: ``json`` (``receipts/step_N.json``), ``safetensors``
    (``receipts/step_N.safetensors``, the per-window arrays as tensors, the same document) or ``auto``: JSON
    unless the per-window arrays hold more than ``receipts_binary_above`` values (docs/record.md#receipts-artifacts)."""
    receipts_binary_above: int = 100_000
    """With ``receipts_format: auto``, the number of per-window array values above which a gate writes the
    safetensors form (100,000: 16 routed layers x 128 experts x 32 canary windows and larger go binary)."""

    def _validate(self, prefix: str) -> None:
        if self.receipts_binary_above < 0:
            raise ConfigError(f"'{prefix}receipts_binary_above' must be >= 0, got {self.receipts_binary_above!r}")
        if self.keep_baselines < 1:
            raise ConfigError(f"'{prefix}keep_baselines' must be >= 1, got {self.keep_baselines!r}")
        if self.param_drift_budget_bytes is not None and self.param_drift_budget_bytes < 1:
            raise ConfigError(f"'{prefix}param_drift_budget_bytes' must be >= 1 or null, got "
                              f"{self.param_drift_budget_bytes!r}")
        if self.keep_receipts is not None and self.keep_receipts < 1:
            raise ConfigError(f"'{prefix}keep_receipts' must be >= 1 or null, got {self.keep_receipts!r}")
        if any(s < 0 for s in self.pin_baselines):
            raise ConfigError(f"'{prefix}pin_baselines' must hold steps >= 0, got {self.pin_baselines!r}")
        if self.every_n_validations < 1:
            raise ConfigError(f"'{prefix}every_n_validations' must be >= 1, got {self.every_n_validations!r}")
        if self.keep_green_checkpoints < 1:
            raise ConfigError(f"'{prefix}keep_green_checkpoints' must be >= 1, got {self.keep_green_checkpoints!r}")
        if self.delivery_wait_s < 0:
            raise ConfigError(f"'{prefix}delivery_wait_s' must be >= 0, got {self.delivery_wait_s!r}")
        if not self.collective_timeout_s > 0:
            raise ConfigError(f"'{prefix}collective_timeout_s' must be > 0, got {self.collective_timeout_s!r}")


@dataclass
class TelemetryConfig:
    """Training-batch routing between gates: what is counted, how often it is written, and the alarm
    (docs/telemetry.md)."""

    enabled: bool = True
    """Count the routes the model's router chooses in every training forward (``atlas/load.jsonl``, trackers, the
    alarm). False: no hooks, no counting."""
    every_n_steps: int | None = None
    """Optimizer steps per logging interval. None: the training framework's logging cadence (Lightning's
    ``log_every_n_steps``, the Trainer's ``logging_steps``), 50 in a plain loop. An interval also ends at every
    gate, so no interval straddles one."""
    picture_every: int = 10
    """Intervals between two layers x experts pictures and tables sent to the trackers (the scalars go every
    interval)."""
    top_experts: int = 3
    """Per-expert tracker keys: the worst layer's this many busiest and idlest experts (0: none)."""
    consecutive: int = 2
    """Intervals in a row a layer must stay in breach of a bound before the alarm is raised (and cleared)."""
    early_gate: bool = True
    """When the alarm is raised, run a gate at the next optimizer-step boundary (its record's ``trigger`` is
    ``telemetry``). The gate, not the alarm, moves the policy's stage."""
    new_dead: int = 1
    """Post-training: experts that carried routes in the reference interval and have none now that put a layer in
    breach (each counted only where ``dead_min_share`` and ``dead_min_expected`` say its silence is news)."""
    dead_min_share: float = 0.25
    """An expert counts as newly dead only when its reference share was at least this fraction of the uniform share
    1/E: an expert already near silent that falls silent is no change of the layer's routing."""
    dead_min_expected: float = 10.0
    """An expert counts as newly dead only where its reference share would have given it at least this many of the
    interval's routes (a Poisson count of mean 10 is 0 with probability 4.5e-5): a short interval is no evidence."""
    share_bound: float = 4.0
    """Post-training: an expert whose share of a layer's routes exceeds this many times the uniform share 1/E, having
    grown ``share_growth``-fold since the reference interval, puts the layer in breach."""
    share_growth: float = 2.0
    """The growth of an expert's share since the reference interval that, beyond ``share_bound``, makes it newly
    overloaded (an expert that hovers at the bound is not news)."""
    cv_rise: float = 0.5
    """Post-training: a rise of a layer's load CV (a fraction) over the reference interval that puts it in breach."""
    entropy_drop: float = 0.1
    """Post-training: a fall of a layer's normalised load entropy below the reference interval's that puts it in
    breach. In pretraining only occupancy collapse (``policy.collapse_*``) puts a layer in breach."""

    def _validate(self, prefix: str) -> None:
        for name in ("picture_every", "consecutive", "new_dead"):
            if getattr(self, name) < 1:
                raise ConfigError(f"'{prefix}{name}' must be >= 1, got {getattr(self, name)!r}")
        if self.every_n_steps is not None and self.every_n_steps < 1:
            raise ConfigError(f"'{prefix}every_n_steps' must be >= 1 or null (the logger's cadence), "
                              f"got {self.every_n_steps!r}")
        if self.top_experts < 0:
            raise ConfigError(f"'{prefix}top_experts' must be >= 0, got {self.top_experts!r}")
        if not self.share_bound > 1:  # NaN fails too: it would switch the bound off unseen
            raise ConfigError(f"'{prefix}share_bound' must be > 1 (a multiple of the uniform share), "
                              f"got {self.share_bound!r}")
        for name in ("cv_rise", "dead_min_expected"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"'{prefix}{name}' must be > 0, got {getattr(self, name)!r}")
        if not self.share_growth >= 1:
            raise ConfigError(f"'{prefix}share_growth' must be >= 1 (a growth factor), got {self.share_growth!r}")
        _check_range(prefix, "dead_min_share", self.dead_min_share, 0.0, 1.0)
        _check_range(prefix, "entropy_drop", self.entropy_drop, 0.0, 1.0, lo_open=True)


@dataclass
class RolloutConfig:
    """Rollout agreement in a reinforcement-learning loop: how often it is measured and the alarm's bounds
    (docs/rollout.md)."""

    enabled: bool = True
    """Measure the rollout agreement a loop hands over (``AtlasGate.rollout``); False: the call does nothing."""
    every_n_steps: int = 1
    """Optimizer steps between two measured rollouts (each costs one forward of the trainer's batch, no gradient);
    the steps in between return at once."""
    mismatch_bound: float = 0.1
    """A routed layer whose mismatch (positions whose two active sets differ, over those compared) exceeds this is
    in breach: a WARN alert names it."""
    fallback_bound: float = 0.01
    """A routed layer whose share of fallback positions (a rollout route that cannot be used: a ``-1`` sentinel, a
    repeated expert) exceeds this is in breach."""
    rise_steps: int = 3
    """A WARN alert when the worst layer's mismatch rose at each of this many recorded steps in a row (0: never)."""
    rise_min: float = 0.02
    """The least rise of the worst layer's mismatch over those steps that makes the alert (a mismatch that creeps by
    noise does not)."""

    def _validate(self, prefix: str) -> None:
        if self.every_n_steps < 1:
            raise ConfigError(f"'{prefix}every_n_steps' must be >= 1, got {self.every_n_steps!r}")
        if self.rise_steps < 0:
            raise ConfigError(f"'{prefix}rise_steps' must be >= 0 (0: no rise alert), got {self.rise_steps!r}")
        for name in ("mismatch_bound", "fallback_bound"):
            _check_range(prefix, name, getattr(self, name), 0.0, 1.0)
        if not self.rise_min >= 0:  # NaN fails too
            raise ConfigError(f"'{prefix}rise_min' must be >= 0, got {self.rise_min!r}")


@dataclass
class AtlasConfig:
    """Everything atlas_tracking can be told. Build it in code, from a dict, or from YAML."""

    receipts: ReceiptsConfig = field(default_factory=ReceiptsConfig)
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> AtlasConfig:
        """Build and validate from a plain mapping (unknown keys and wrong types are errors)."""
        return _build(cls, data or {}, "")

    @classmethod
    def from_yaml(cls, path: str | Path) -> AtlasConfig:
        """Load from a YAML file with ``yaml.safe_load``."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        return cls.from_dict(data)

    @classmethod
    def coerce(cls, config: AtlasConfig | dict | str | Path | None) -> AtlasConfig:
        """Accept an AtlasConfig, a dict, a YAML path, or None (defaults)."""
        if config is None:
            return cls()
        if isinstance(config, AtlasConfig):
            return config
        if isinstance(config, dict):
            return cls.from_dict(config)
        if isinstance(config, (str, Path)):
            return cls.from_yaml(config)
        raise ConfigError(f"config must be an AtlasConfig, a dict or a YAML path, not {type(config).__name__}")

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON- and YAML-safe mapping that ``from_dict`` reads back."""
        return dataclasses.asdict(self)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (inner,) = typing.get_args(tp)
        return f"a list of {_type_name(inner)}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return {float: "a number", int: "an integer", bool: "true/false", str: "a string", type(None): "null"}.get(
        tp, str(tp))


_SCALAR_CHECKS: dict[type, Any] = {
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) is not bool:
            return value
    elif origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _convert(arg, value, key)
            except ConfigError:
                continue
    elif origin is list:
        (inner,) = typing.get_args(tp)
        if isinstance(value, (list, tuple)):
            return [_convert(inner, v, f"{key}[{i}]") for i, v in enumerate(value)]
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            return _build(tp, value, key + ".")
    elif tp is type(None) and value is None:
        return None
    elif tp in _SCALAR_CHECKS and _SCALAR_CHECKS[tp](value):
        return float(value) if tp is float else value
    raise ConfigError(f"'{key}' must be {_type_name(tp)}, got {value!r}")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"'{prefix.rstrip('.') or 'config'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown key '{prefix}{key}'; allowed keys: {', '.join(names)}")
    kwargs = {k: _convert(hints[k], v, prefix + k) for k, v in data.items()}
    obj = cls(**kwargs)
    validate = getattr(obj, "_validate", None)
    if validate is not None:
        validate(prefix)
    return obj


def _check_range(prefix: str, name: str, value: float, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        bracket = "(" if lo_open else "["
        raise ConfigError(f"'{prefix}{name}' must be in {bracket}{lo}, {hi}], got {value!r}")
