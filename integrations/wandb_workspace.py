"""A saved W&B workspace laid out as the atlas gate reads, built with ``wandb-workspaces``.

The layout is plain data (:func:`workspace_sections`), so it can be checked offline against the keys
:class:`~atlas_tracking.integrations.wandb.WandbSink` really logs; :func:`build_workspace` turns it
into a ``wandb_workspaces.workspaces.Workspace`` (no network) and :func:`save_workspace` saves it to
a W&B project (needs a W&B login). Sections, top to bottom: the verdict (status, stage, loss beside
C2, the gate table), occupancy, the training batches between gates (docs/telemetry.md), State2 and the V2 axes, drift and the lifecycle margins,
the router-expert coupling (docs/receipts.md#router-expert-coupling), and, closed
by default, the rollout agreement of a reinforcement-learning loop (docs/rollout.md), the per-layer series, the layers x gates C2 heatmap and the per-layer bar charts. The
workspace does not auto-generate panels, so a deep model's per-layer keys stay in their own section. For a
top-1 model (a record whose gates state ``c2_absent: top-1 routing``) the panels whose only series is C2 are
markdown panels titled "C2: n/a (top-1)": the sink logs no C2 key there.

Example (offline: the layout for a 4-layer model):
    >>> from atlas_tracking.integrations.wandb_workspace import workspace_sections, logged_keys
    >>> [s.name for s in workspace_sections(n_layers=4)]
    ['atlas: verdict', 'atlas: occupancy', 'atlas: between gates (training batches)', 'atlas: State2 and V2', 'atlas: drift and lifecycle', 'atlas: router-expert coupling', 'atlas: rollout agreement (reinforcement learning)', 'atlas: per layer']
    >>> "atlas/layer_03/c2" in logged_keys(workspace_sections(n_layers=4))
    True
    >>> [p.title for p in workspace_sections(n_layers=4, top1=True)[3].panels][0]
    'C2: n/a (top-1)'

From the command line (``--print`` shows the layout without contacting W&B)::
    atlas-tracking wandb-workspace --entity ENTITY --project PROJECT --record atlas/gates.jsonl
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from atlas_tracking.integrations.wandb import STEP_KEY

from atlas_tracking.receipts.param_drift import GROUPS as PARAM_GROUPS
from atlas_tracking.schema.config import TelemetryConfig
from atlas_tracking.schema.record import LAYER_METRICS, METRIC_NAMES
from atlas_tracking.schema.verdict import LEVEL_LEGEND
from atlas_tracking.sinks.jsonl import JsonlSink
from atlas_tracking.viz.tables import NA_TOP1, top1

PanelKind = Literal["line", "media", "bar", "table", "markdown"]
TOP_EXPERTS = TelemetryConfig().top_experts
"""The busiest and idlest experts of the worst layer the layout shows (``telemetry.top_experts``' default)."""


@dataclass(frozen=True)
class PanelSpec:
    """One panel: a line plot of history keys, a media browser, a bar chart of a logged table, or a table."""

    kind: PanelKind
    title: str
    keys: tuple[str, ...]
    """History keys the panel reads (for ``bar``: the table key ``wandb.plot.bar`` logs)."""
    fields: dict[str, str] = field(default_factory=dict)
    """Bar charts: the table columns for the label and the value."""
    text: str = ""
    """Markdown panels: what they say."""


@dataclass(frozen=True)
class SectionSpec:
    name: str
    panels: tuple[PanelSpec, ...]
    is_open: bool = True


def _line(title: str, *metrics: str) -> PanelSpec:
    """A line plot of gate summaries, by their tracker names (``mean_cv`` is logged as ``mean_cv_pct``)."""
    return PanelSpec("line", title, tuple(f"atlas/{METRIC_NAMES.get(m, m)}" for m in metrics))


def _bar(title: str, chart_key: str, value: str) -> PanelSpec:
    return PanelSpec("bar", title, (f"{chart_key}_table",), {"label": "layer", "value": value})


TOP1_PANEL = PanelSpec("markdown", f"C2: {NA_TOP1}", (), text=(
    f"**C2: {NA_TOP1}.** Top-1 routing has no co-active pairs, so C2, its changes and the C2 charts are absent "
    "(never 0); occupancy, State1, drift and State3 carry the read."))
"""What stands where a C2 panel would be for a top-1 model."""


def _c2_only(spec: PanelSpec) -> bool:
    """Every series of ``spec`` is C2 or derived from it (``atlas/c2``, ``atlas/layer_03/c2_delta``, ...)."""
    return bool(spec.keys) and all(k.split("/")[-1].startswith("c2") for k in spec.keys)


def workspace_sections(n_layers: int, param_groups: tuple[str, ...] = PARAM_GROUPS,
                       top1: bool = False) -> list[SectionSpec]:
    """The gate's layout for a model with ``n_layers`` routed layers (per-layer section closed).

    ``param_groups`` are the module groups the model's parameter drift is logged for (``atlas/param_drift/*``;
    :func:`record_layout` reads them from a run's record; empty: no parameter-drift panels). ``top1``: the model
    routes top-1 (:func:`record_top1`), and each panel whose only series is C2 is :data:`TOP1_PANEL` (once per
    section).
    """
    sections = _sections(n_layers, param_groups)
    if not top1:
        return sections
    out = []
    for s in sections:
        panels: list[PanelSpec] = []
        for p in (TOP1_PANEL if _c2_only(p) else p for p in s.panels):
            if p is not TOP1_PANEL or TOP1_PANEL not in panels:
                panels.append(p)
        out.append(SectionSpec(s.name, tuple(panels), s.is_open))
    return out


def _sections(n_layers: int, param_groups: tuple[str, ...]) -> list[SectionSpec]:
    """The layout of :func:`workspace_sections` for a model with C2."""
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    unknown = set(param_groups) - set(PARAM_GROUPS)
    if unknown:
        raise ValueError(f"unknown parameter groups {sorted(unknown)}; known: {', '.join(PARAM_GROUPS)}")
    drift_groups = (*param_groups, "total") if param_groups else ()
    param_panels = (
        _line("parameter drift ||θ - θ_ref|| / ||θ_ref|| per module group (the contrast, not the verdict)",
              *(f"param_drift/{g}" for g in drift_groups)),
        _line("parameters moved per module group (elements != the baseline's)",
              *(f"param_drift/{g}_moved" for g in drift_groups)),
    ) if drift_groups else ()
    per_layer = tuple(
        PanelSpec("line", f"{metric} per layer", tuple(f"atlas/layer_{i:02d}/{metric}" for i in range(n_layers)))
        for metric in LAYER_METRICS
    )
    return [
        SectionSpec("atlas: verdict", (
            _line(f"verdict, what the badge and tags show ({LEVEL_LEGEND})", "verdict_code"),
            _line("receipt-level status (BASELINE 0, GREEN 1, YELLOW 2, RED 3)", "status_code"),
            _line("stage (baseline 0 ... intervene 6; pretraining: forming 7, ready 8, collapse 9, stable 10)",
                  "stage_code"),
            _line("post-training predicates: protected-atlas rewrite, base-domain damage (pass 0, at risk 1, fail 2)",
                  "predicate/protected_rewrite", "predicate/base_damage"),
            _line("validation loss", "loss"),
            _line("C2 (all layers, protected layers)", "c2", "c2_protected"),
            PanelSpec("table", "last gate: verdict and its source, status, stage, action", ("atlas/gate",)),
        )),
        SectionSpec("atlas: occupancy", (
            _line("dead experts (mean, worst layer)", "dead_experts", "dead_experts_max"),
            _line("router entropy (min, mean over layers; nats)", "min_entropy", "mean_entropy"),
            _line("load CV x100 (mean, worst layer)", "mean_cv", "max_cv"),
            _line("experts active (mean over layers)", "experts_active"),
        )),
        SectionSpec("atlas: between gates (training batches)", (
            _line("load CV, worst layer; busiest expert over the mean", "train/load_cv_max", "train/max_over_mean"),
            _line("dead fraction (worst layer), normalised entropy (lowest layer)", "train/dead_fraction_max",
                  "train/entropy_min"),
            _line("alarm: layers in breach, alarm standing (1)", "train/breach_layers", "train/alarm"),
            _line("the worst layer (the model's layer number); tokens routed per layer in the interval",
                  "train/worst_layer", "train/tokens"),
            _line("the worst layer's busiest and idlest experts' shares of its routes",
                  *(f"train/{end}{i}_share" for end in ("top", "bottom") for i in range(1, TOP_EXPERTS + 1))),
            _line("their expert ids", *(f"train/{end}{i}_expert" for end in ("top", "bottom")
                                        for i in range(1, TOP_EXPERTS + 1))),
            PanelSpec("media", "training-batch expert load: layers x experts", ("atlas/train/expert_load",)),
        )),
        SectionSpec("atlas: State2 and V2", (
            _line("C2 (mean, worst layer)", "c2", "c2_min"),
            _line("layers passing V2 C1 / V2 C2", "v2_c1_pass_layers", "v2_c2_pass_layers"),
            _line("transition incompatibility (median over the boundary set)", "transition_incompat"),
            _line("routing self-consistency ov_cf", "ov_cf"),
            _line("ov_cf terminal cliff: last routed layer minus the band before it / minus the layer before it",
                  "ov_cf_terminal_jump", "ov_cf_adjacent_jump"),
            _line("State1 set margin (decisiveness, not health)", "margin"),
            _line("State1 near-tie mass: share of tokens within bf16 / fp16 rounding of a tie (mean, worst layer)",
                  "near_tie_bf16", "near_tie_bf16_max", "near_tie_fp16", "near_tie_fp16_max"),
            _line("canary NLL", "canary_nll"),
        )),
        SectionSpec("atlas: drift and lifecycle", (
            _line("handoff and refinement margins (positive: inside)", "handoff_margin", "refine_margin"),
            _line("base-domain damage: bounded KL(base || now), canary NLL minus the baseline's", "kl_base",
                  "canary_nll_delta"),
            _line("base-domain damage since the post-training base (across resumes): bounded KL, canary NLL change",
                  "kl_base_cumulative", "canary_nll_delta_cumulative"),
            *param_panels,
            _line("gate wall time (s)", "gate_seconds"),
            _line("gate's share of the wall time since the previous gate (the cost of gating this often)",
                  "gate_share"),
        )),
        SectionSpec("atlas: router-expert coupling", (
            _line("alignment of router rows with their tokens (mean median, lowest lower decile)", "alignment_median",
                  "alignment_p10_min"),
            _line("share of experts whose router row points away from their tokens", "alignment_negative"),
            _line("co-movement since the baseline: row change vs mean-state / mean-field change (median)",
                  "comove_state", "comove_field"),
            _line("share of experts whose row moved against their tokens; rows that did not move (a frozen router)",
                  "comove_state_against", "comove_router_still"),
        )),
        SectionSpec("atlas: rollout agreement (reinforcement learning)", (
            _line("mismatch: worst layer, mean over layers; positions routed differently in some layer",
                  "rollout/mismatch_max", "rollout/mismatch_mean", "rollout/token_mismatch"),
            _line("Jaccard index of the two active sets (lowest layer); fallback share", "rollout/jaccard_min",
                  "rollout/fallback_share"),
            _line("near ties at bf16 (highest layer); alert standing (1)", "rollout/near_tie_bf16_max", "rollout/alarm"),
            _line("log-probabilities: mean |trainer - rollout|, k3 KL(rollout || trainer)", "rollout/logprob_abs_diff",
                  "rollout/k3"),
            _line("the worst layer (the model's layer number)", "rollout/worst_layer"),
        ), is_open=False),
        SectionSpec("atlas: per layer", (
            *per_layer,
            PanelSpec("media", "C2: layers x gates", ("atlas/c2_heatmap",)),
            _bar("C2 per layer (last gate)", "atlas/c2_by_layer", "c2"),
            _bar("dead experts per layer (last gate)", "atlas/dead_by_layer", "dead_experts"),
            PanelSpec("table", "per-layer receipts (last gate)", ("atlas/layers",)),
            PanelSpec("media", "expert load: layers x experts (share, change since the baseline)", ("atlas/expert_load",)),
            PanelSpec("table", "per-expert load (last gate)", ("atlas/experts",)),
        ), is_open=False),
    ]


def logged_keys(sections: list[SectionSpec]) -> set[str]:
    """Every history key the layout reads."""
    return {key for s in sections for p in s.panels for key in p.keys}


def record_top1(path: str | Path) -> bool:
    """A local ``gates.jsonl`` record whose last gate states that C2 is absent because of top-1 routing."""
    records = JsonlSink(path).records()
    return bool(records) and top1(records[-1])


def record_layout(path: str | Path) -> tuple[int, tuple[str, ...]]:
    """From a local ``gates.jsonl`` record: the routed-layer count of its last gate, and the module groups of
    the parameter drift in the last gate that has one (in :data:`PARAM_GROUPS` order; all of them when no
    gate has parameter drift yet)."""

    records = JsonlSink(path).records()
    if not records:
        raise ValueError(f"{path} holds no gate record to read the layer count from")
    drift = next((r["param_drift"] for r in reversed(records) if r.get("param_drift")), None)
    groups = PARAM_GROUPS if drift is None else tuple(g for g in PARAM_GROUPS if g in drift["groups"])
    return len(records[-1].get("layers", [])), groups


def _panel(spec: PanelSpec, x_axis: str) -> Any:
    import wandb_workspaces.reports.v2 as wr

    if spec.kind == "line":
        return wr.LinePlot(title=spec.title, x=x_axis, y=list(spec.keys))
    if spec.kind == "media":
        return wr.MediaBrowser(title=spec.title, media_keys=list(spec.keys), mode="gallery", gallery_axis="step")
    if spec.kind == "markdown":
        return wr.MarkdownPanel(markdown=spec.text)
    if spec.kind == "bar":
        return wr.CustomChart(query={"summaryTable": {"tableKey": spec.keys[0]}}, chart_name="wandb/bar/v0",
                              chart_fields=dict(spec.fields), chart_strings={"title": spec.title})
    return wr.WeavePanelSummaryTable(table_name=spec.keys[0])


def build_workspace(entity: str, project: str, n_layers: int, name: str = "atlas gate", x_axis: str = STEP_KEY,
                    param_groups: tuple[str, ...] = PARAM_GROUPS, top1: bool = False) -> Any:
    """A ``wandb_workspaces`` Workspace for the gate (built offline; call ``.save()`` to publish it).

    ``x_axis`` is the step metric the gates are logged against: ``trainer/global_step`` for Lightning's
    ``WandbLogger`` and a plain ``WandbSink``, ``train/global_step`` for the transformers Trainer
    (:data:`atlas_tracking.integrations.transformers.TRAINER_STEP_KEY`).
    """
    import wandb_workspaces.workspaces as ws

    sections = [ws.Section(name=s.name, panels=[_panel(p, x_axis) for p in s.panels], is_open=s.is_open)
                for s in workspace_sections(n_layers, param_groups, top1)]
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections)


def save_workspace(entity: str, project: str, n_layers: int, name: str = "atlas gate", x_axis: str = STEP_KEY,
                   param_groups: tuple[str, ...] = PARAM_GROUPS, top1: bool = False) -> str:
    """Build and save the workspace to W&B; returns its URL."""
    workspace = build_workspace(entity, project, n_layers, name, x_axis, param_groups, top1)
    workspace.save()
    return str(workspace.url)


def _spec_json(n_layers: int, x_axis: str, param_groups: tuple[str, ...], top1: bool = False) -> str:
    def panel(p: PanelSpec) -> dict[str, Any]:
        return {"kind": p.kind, "title": p.title, "keys": list(p.keys), **({"x": x_axis} if p.kind == "line" else {}),
                **({"text": p.text} if p.text else {})}

    return json.dumps([{"section": s.name, "open": s.is_open, "panels": [panel(p) for p in s.panels]}
                       for s in workspace_sections(n_layers, param_groups, top1)], indent=1)


def cmd_wandb_workspace(args: argparse.Namespace) -> int:
    n_layers, groups = (args.layers, PARAM_GROUPS) if args.record is None else record_layout(args.record)
    is_top1 = args.record is not None and record_top1(args.record)
    if args.print:
        print(_spec_json(n_layers, args.x_axis, groups, is_top1))
        return 0
    from wandb.errors import Error as WandbError

    try:
        url = save_workspace(args.entity, args.project, n_layers, args.name, args.x_axis, groups, is_top1)
    except ImportError as exc:
        raise ValueError(f"saving a workspace needs wandb-workspaces (pip install 'atlas-tracking[wandb]'): {exc}") from None
    except WandbError as exc:  # no login, no network, an unknown entity: one line, the advice first
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"log in to W&B first (`wandb login` or WANDB_API_KEY), or pass --print to print the layout "
                         f"without W&B ({type(exc).__name__}: {first})") from None
    print(f"saved W&B workspace '{args.name}' ({n_layers} routed layers): {url}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("wandb-workspace", help="create a W&B workspace laid out for the atlas gate")
    p.add_argument("--entity", required=True)
    p.add_argument("--project", required=True)
    p.add_argument("--name", default="atlas gate", help="workspace (view) name")
    count = p.add_mutually_exclusive_group(required=True)
    count.add_argument("--layers", type=int, help="number of routed layers")
    count.add_argument("--record", help="a run's atlas/gates.jsonl (the layer count is read from it)")
    p.add_argument("--x-axis", default=STEP_KEY,
                   help=f"the step metric of the line plots (default {STEP_KEY}; train/global_step for the "
                        "transformers Trainer)")
    p.add_argument("--print", action="store_true", help="print the layout as JSON instead of saving it")
    p.set_defaults(func=cmd_wandb_workspace)
