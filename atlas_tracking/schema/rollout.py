"""The rollout-agreement record: one JSON object per recorded training step, the line appended to
``atlas/rollout.jsonl``.

Declared as the load record is (:mod:`atlas_tracking.schema.load`): each section a ``TypedDict`` whose fields carry
their type and a docstring; the bounded summary a tracker receives per recorded step is :class:`RolloutSummary`,
each field marked with its tracker key (``atlas/rollout/...``). docs/rollout.md shows both tables, generated from
these declarations.

Example:
    >>> SUMMARY_KEYS["mismatch_max"], len(SUMMARY_KEYS)
    ('atlas/rollout/mismatch_max', 10)
"""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

from atlas_tracking.schema.record import Metric, metric_fields

ROLLOUT_SCHEMA_VERSION = 1
"""The version of the lines this package writes to ``rollout.jsonl`` (a line states it as ``schema_version``)."""


class RolloutLayer(TypedDict, total=False):
    """One routed layer of a recorded step (``line["layers"][i]``), over every process's batch."""

    layer: int
    """The model's own layer number (the decoder layer holding the block)."""
    name: str
    """Module path of the MoE block."""
    tokens: int
    """Token positions compared or counted as fallback (where the attention mask is 1)."""
    compared: int
    """Positions whose two active sets were compared (``tokens - fallback``)."""
    fallback: int
    """Positions whose rollout route is not a set of k distinct experts (a ``-1`` sentinel, a repeated expert): a
    replay cannot apply it; counted, never compared."""
    mismatched: int
    """Compared positions whose two active sets differ as sets."""
    mismatch: float | None
    """``mismatched / compared``."""
    jaccard: float | None
    """The mean Jaccard index of the two active sets over the compared positions."""
    routes: int
    """``k x compared``."""
    routes_moved: int
    """Routes sent to an expert the other engine did not choose."""
    near_tie: dict[str, float | None]
    """Per precision (``bf16``, ``fp16``): the share of compared positions with an eligible competitor whose
    relative set margin is within that precision's rounding."""
    perturbation: dict[str, float] | None
    """Over the mismatched positions: the ``median``, ``p90`` and ``max`` of the relative score gap the rollout's
    choice overcame; None without a mismatch (or when every mismatch is an expert the trainer cannot select)."""
    boundary_mass: float | None
    """The share of compared positions whose relative set margin is at most the perturbation's median."""


class RolloutLine(TypedDict, total=False):
    """One line of ``rollout.jsonl``: the routing agreement of one recorded training step."""

    schema_version: int
    """The line's schema version."""
    step: int
    """The optimizer step the rollout was trained on (the line's key)."""
    tokens: int
    """Token positions where the attention mask is 1, over every process."""
    processes: int
    """Processes whose batches the line sums."""
    layer_axis: str
    """``routed`` (one row per routed layer) or ``decoder`` (one row per decoder layer, vLLM's and SGLang's layout):
    the layer axis of the rollout's array."""
    replayed: bool
    """The update replayed the rollout's routes (``fallback`` counts the positions where the replay could not
    apply)."""
    layers: list[RolloutLayer]
    """One entry per routed layer of the model, in forward order."""
    first_mismatch: dict[str, Any]
    """Per token position, the first routed layer whose two sets differ: ``by_layer`` (counts per model layer
    number), ``none`` (positions where every layer agrees) and ``tokens``."""
    logprobs: dict[str, Any]
    """With the rollout's log-probabilities: ``tokens``, ``abs_diff_mean`` and ``k3`` (the k3 estimate of
    KL(rollout || trainer))."""
    run_id: str
    """The run, constant across resumes."""
    branch: str
    """The training segment that wrote the line (a resume moves lines of an abandoned branch aside)."""
    breach: list[dict[str, Any]]
    """What crossed a bound at this step: ``layer``, ``name`` and the reason (mismatch above
    ``rollout.mismatch_bound``, fallback above ``rollout.fallback_bound``)."""
    rising: int
    """Consecutive recorded steps, up to this one, at which the worst layer's mismatch rose."""
    alerts: list[dict[str, Any]]
    """The alerts this step raised (a bound crossed, a sustained rise, or their clearing)."""


class RolloutSummary(TypedDict, total=False):
    """The bounded summary of one recorded step that trackers receive, whatever the number of layers."""

    mismatch_max: Annotated[float, Metric("rollout/mismatch_max")]
    """The largest per-layer mismatch (share of compared positions whose two active sets differ)."""
    worst_layer: Annotated[int, Metric("rollout/worst_layer")]
    """The model's layer number of the layer with the largest mismatch."""
    mismatch_mean: Annotated[float, Metric("rollout/mismatch_mean")]
    """Mismatched positions over compared positions, over every routed layer."""
    token_mismatch: Annotated[float, Metric("rollout/token_mismatch")]
    """The share of token positions whose routing differs in at least one routed layer."""
    jaccard_min: Annotated[float, Metric("rollout/jaccard_min")]
    """The smallest per-layer mean Jaccard index of the two active sets."""
    fallback_share: Annotated[float, Metric("rollout/fallback_share")]
    """Fallback positions over token positions, over every routed layer."""
    near_tie_bf16_max: Annotated[float, Metric("rollout/near_tie_bf16_max")]
    """The largest per-layer share of compared positions that are near ties at bf16."""
    logprob_abs_diff: Annotated[float | None, Metric("rollout/logprob_abs_diff")]
    """With the rollout's log-probabilities: the mean absolute difference of the two engines' log-probabilities."""
    k3: Annotated[float | None, Metric("rollout/k3")]
    """With the rollout's log-probabilities: the k3 estimate of KL(rollout || trainer)."""
    alarm: Annotated[int, Metric("rollout/alarm")]
    """1 while a rollout-agreement alert stands (a bound crossed, or a sustained rise), else 0."""


SUMMARY_KEYS = {name: f"atlas/{key}" for name, key in metric_fields(RolloutSummary).items()}
"""Summary field -> tracker key (``atlas/rollout/...``)."""
