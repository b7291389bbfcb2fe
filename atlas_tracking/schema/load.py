"""The training-batch load record: one JSON object per logging interval, the line appended to ``atlas/load.jsonl``.

Declared here as the gate record is (:mod:`atlas_tracking.schema.record`): each section a ``TypedDict`` whose fields
carry their type and a docstring; the bounded summary a tracker receives per interval is :class:`LoadSummary`,
each field marked with its tracker key (``atlas/train/...``). docs/telemetry.md shows both tables, generated from
these declarations.

Example:
    >>> SUMMARY_KEYS["load_cv_max"], len(SUMMARY_KEYS)
    ('atlas/train/load_cv_max', 10)
    >>> ranked_keys(2)[:3]
    ['atlas/train/top1_expert', 'atlas/train/top1_share', 'atlas/train/top2_expert']
"""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

from atlas_tracking.schema.record import Metric, metric_fields

LOAD_SCHEMA_VERSION = 2
"""The version of the lines this package writes to ``load.jsonl`` (a line states it as ``schema_version``). Version 2
counts only the router calls of training forwards with gradients on (docs/telemetry.md#what-is-counted); version 1
also counted training-mode passes without gradients (:data:`COUNTED_NO_GRAD_PASSES`)."""
COUNTED_NO_GRAD_PASSES = 1
"""The ``load.jsonl`` version whose intervals also counted training-mode passes without gradients (a log-probability
pass, a generation under ``no_grad``): read beside later intervals, its loads are not on the same footing."""


class LoadLayer(TypedDict, total=False):
    """One routed layer of an interval (``line["layers"][i]``), summed over every process."""

    layer: int
    """The model's own layer number (the decoder layer holding the block; the same on every pipeline stage)."""
    name: str
    """Module path of the MoE block (on the first process that holds it)."""
    load: list[int]
    """Routes the model's router chose to each expert in the interval (dropped routes included)."""
    dropped: int | None
    """Of those, the routes a capacity limit dropped; None for a layer that never drops (no capacity limit)."""
    tokens: int
    """Token positions the layer's router saw in the interval (``sum(load) = k tokens`` unless it skips tokens)."""
    calls: int
    """Router calls counted (one per micro-batch forward of each process; a checkpoint's recomputation is not one)."""
    processes: int
    """Processes that counted this layer (its data-parallel replicas; under pipeline parallelism, those of its
    stage)."""
    ep_ranks: list[int]
    """An expert-parallel layer only: the global ranks of the processes that hold its experts."""
    ep_tokens: list[int]
    """An expert-parallel layer only: the routes each process of ``ep_ranks`` received for the experts it holds (the
    routes the capacity limit kept, summed over the processes that sent them)."""


class LoadLine(TypedDict, total=False):
    """One line of ``load.jsonl``: the training-batch routes of one logging interval."""

    schema_version: int
    """The line's schema version."""
    step: int
    """The last optimizer step of the interval (the line's key)."""
    first_step: int
    """The first optimizer step of the interval."""
    tokens: int
    """Token positions routed per layer in the interval, over every process (the largest layer's count)."""
    layers: list[LoadLayer]
    """One entry per routed layer of the model, in layer order."""
    run_id: str
    """The run, constant across resumes."""
    branch: str
    """The training segment that wrote the line (a resume moves lines of an abandoned branch aside)."""
    phase: str
    """The phase the alarm read the interval in (pretraining: collapse only; post_training: change against the
    reference interval)."""
    reference_step: int | None
    """Post-training: the last step of the reference interval the alarm compares with (the first interval after
    the baseline gate); None before it exists."""
    breach: list[dict[str, Any]]
    """The layers in breach of an alarm bound at this interval: ``layer``, ``name``, what crossed which bound, and
    the experts involved."""
    alerts: list[dict[str, Any]]
    """The alerts this interval raised (an alarm, or its clearing)."""
    alarm: bool
    """An alarm stands after this interval (raised, and not yet cleared)."""
    alarm_layers: list[str]
    """The layers the standing alarm stands for (those that stayed in breach ``telemetry.consecutive`` intervals and
    have not cleared)."""
    early_gate: bool
    """This interval asked for an early gate (``telemetry.early_gate``)."""
    uncounted: list[int]
    """After a resume: the steps ``[first, last]`` whose routes no line holds (counted by a process that is gone
    before its interval was written)."""
    errors: list[str]
    """Router calls that could not be counted (the layer and the error), on the process that writes the line."""


class LoadSummary(TypedDict, total=False):
    """The bounded summary of one interval that trackers receive, whatever the number of layers and experts."""

    tokens: Annotated[int, Metric("train/tokens")]
    """Token positions routed per layer in the interval, over every process."""
    load_cv_max: Annotated[float, Metric("train/load_cv_max")]
    """The largest load CV over the routed layers (population std over mean of the per-expert routes)."""
    worst_layer: Annotated[int, Metric("train/worst_layer")]
    """The model's layer number of the layer with the largest load CV (``top*`` and ``bottom*`` are its experts)."""
    max_over_mean: Annotated[float, Metric("train/max_over_mean")]
    """The largest load over the mean load, over the routed layers (the busiest expert's share over 1/E)."""
    dead_fraction_max: Annotated[float, Metric("train/dead_fraction_max")]
    """The largest share of a layer's experts that received no route in the interval."""
    entropy_min: Annotated[float, Metric("train/entropy_min")]
    """The smallest normalised entropy of the load shares over the routed layers (1 is uniform)."""
    overload_factor: Annotated[float | None, Metric("train/overload_factor")]
    """Expert parallelism only: the largest, over the layers, of the most routes a process received over the mean."""
    dropped_fraction: Annotated[float | None, Metric("train/dropped_fraction")]
    """Layers with a capacity limit only: the dropped routes over the routes chosen, over those layers."""
    breach_layers: Annotated[int, Metric("train/breach_layers")]
    """Routed layers in breach of an alarm bound at this interval."""
    alarm: Annotated[int, Metric("train/alarm")]
    """1 while an alarm stands (some layer stayed in breach for ``telemetry.consecutive`` intervals), else 0."""


SUMMARY_KEYS = {name: f"atlas/{key}" for name, key in metric_fields(LoadSummary).items()}
"""Summary field -> tracker key (``atlas/train/...``)."""


def ranked_keys(count: int) -> list[str]:
    """The per-expert keys of the worst layer's ``count`` busiest and ``count`` idlest experts: their expert ids
    and shares of the layer's routes."""
    return [f"atlas/train/{end}{i}_{what}" for end in ("top", "bottom") for i in range(1, count + 1)
            for what in ("expert", "share")]
