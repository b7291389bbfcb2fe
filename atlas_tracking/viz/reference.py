"""Reference tables generated from the code, so the docs cannot drift from it.

The docs build (``make docs``; ``docs/hooks.py``) replaces each ``<!-- generated: NAME -->`` line of a
page with the Markdown table :data:`GENERATORS` makes from its declaration:

- ``configuration``: every key of the configuration tree (:mod:`atlas_tracking.schema.config`), its type,
  default and docstring;
- ``record-fields``: every field of the gate record (:mod:`atlas_tracking.schema.record`) by section;
- ``load-fields``: every field of a line of ``load.jsonl`` and of its layers (:mod:`atlas_tracking.schema.load`);
- ``rollout-fields``: every field of a line of ``rollout.jsonl`` and of its layers
  (:mod:`atlas_tracking.schema.rollout`);
- ``tracker-keys``: every key a tracker receives, derived from the :class:`Metric` marks of the gate record and
  of the training-batch summary (:class:`~atlas_tracking.schema.load.LoadSummary`);
- ``families``: the transformers family table (:mod:`atlas_tracking.adapters.families`), read and refused.

Example:
    >>> print(tracker_keys().splitlines()[2])
    | `atlas/c2` | summary | Mean C2 over the routed layers. |
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import sys
import textwrap
import typing
from collections.abc import Callable
from typing import Any

from atlas_tracking.adapters.families import FAMILIES, REFUSED, REFUSED_ALIASES
from atlas_tracking.adapters.hf import Family
from atlas_tracking.receipts.param_drift import GROUPS as PARAM_GROUPS
from atlas_tracking.schema import config as config_schema
from atlas_tracking.schema import load as load_schema
from atlas_tracking.schema import record as record_schema
from atlas_tracking.schema import rollout as rollout_schema
from atlas_tracking.schema.config import AtlasConfig
from atlas_tracking.schema.interventions import recipes_table
from atlas_tracking.schema.record import METRIC_NAMES, VERDICT_CODES, Stage, Status, metric_fields
from atlas_tracking.schema.verdict import code_legends


def attribute_docs(cls: type) -> dict[str, str]:
    """The docstring written under each attribute of a class body (dataclasses, TypedDicts, enums).

    >>> list(attribute_docs(record_schema.Margins))
    ['handoff_margin', 'refine_margin', 'handoff_layer', 'refine_layer', 'refine_margin_ci', 'refine_reference']
    >>> attribute_docs(record_schema.Summary)["c2"]
    'Mean C2 over the routed layers.'

    A TypedDict's bases are not in its ``__mro__``; they are read from its class statement:

    >>> attribute_docs(record_schema.LayerRecord)["c2"] == attribute_docs(record_schema.LayerReceipts)["c2"]
    True
    """
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__ in ("builtins", "typing", "enum"):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        statement = ast.parse(source).body[0]
        if typing.is_typeddict(klass):
            for base in statement.bases:  # type: ignore[attr-defined]
                parent = getattr(sys.modules[klass.__module__], base.id, None) if isinstance(base, ast.Name) else None
                if parent is not klass and typing.is_typeddict(parent):
                    out.update(attribute_docs(parent))
        body = statement.body  # type: ignore[attr-defined]
        for node, after in itertools.pairwise(body):
            name = None
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                name = node.target.id
            elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
            if name and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                    and isinstance(after.value.value, str):
                out[name] = " ".join(after.value.value.split())
    return out


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _type_text(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    text = getattr(tp, "__name__", None) if isinstance(tp, type) else None
    return text or re.sub(r"atlas_tracking\.schema\.\w+\.", "", str(tp).replace("typing.", ""))


# --- configuration ------------------------------------------------------------------------------------


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "required"


def configuration() -> str:
    """One table per section of ``atlas.yaml``: key, allowed values, default, meaning."""
    parts = []
    sections = [(f.name, typing.get_type_hints(AtlasConfig)[f.name]) for f in dataclasses.fields(AtlasConfig)]
    sections.append(("alerts.rules[]", config_schema.AlertRule))
    for section, cls in sections:
        hints, docs = typing.get_type_hints(cls), attribute_docs(cls)
        rows = []
        for f in dataclasses.fields(cls):
            if f.name.startswith("_"):
                continue
            default = _default(f)
            if dataclasses.is_dataclass(default) or (isinstance(default, list) and default
                                                     and dataclasses.is_dataclass(default[0])):
                default = "see below" if section == "alerts" else default
            rows.append([f"`{f.name}`", config_schema._type_name(hints[f.name]), f"`{default!r}`",
                         docs.get(f.name, "")])
        doc = " ".join((inspect.getdoc(cls) or "").split())
        parts.append(f"### `{section}`\n\n{doc}\n\n" + _table(["key", "allowed", "default", "meaning"], rows))
    return "\n\n".join(parts)


# --- the gate record ----------------------------------------------------------------------------------

RECORD_SECTIONS = ("Gate", "Summary", "Cliff", "Deltas", "Margins", "BaseDamage", "CoMovement", "GateDecision",
                   "LayerIdentity", "LayerReceipts", "LayerDrift", "LayerExperts", "FailedGate")
"""The sections of :class:`~atlas_tracking.schema.record.GateRecord` in the order the docs list them, then the
line of ``errors.jsonl`` (:class:`~atlas_tracking.schema.record.FailedGate`)."""


def record_fields() -> str:
    """One table per section of the gate record: field, type, tracker key, meaning."""
    parts = []
    for name in RECORD_SECTIONS:
        cls = getattr(record_schema, name)
        hints = typing.get_type_hints(cls, vars(record_schema), include_extras=True)
        docs, tracked = attribute_docs(cls), metric_fields(cls)
        prefix = "atlas/layer_NN/" if name.startswith("Layer") else "atlas/"
        rows = [[f"`{key}`", f"`{_type_text(tp)}`", f"`{prefix}{tracked[key]}`" if key in tracked else "",
                 docs.get(key, "")] for key, tp in hints.items()]
        where = ("each entry of `layers`" if name.startswith("Layer") else "a line of `errors.jsonl`"
                 if name == "FailedGate" else "the record")
        doc = " ".join((inspect.getdoc(cls) or "").split())
        parts.append(f"### {name} ({where})\n\n{doc}\n\n" + _table(["field", "type", "tracker key", "meaning"], rows))
    return "\n\n".join(parts)


# --- the training-batch load record ---------------------------------------------------------------------

LOAD_SECTIONS = (("LoadLine", "a line of `load.jsonl`"), ("LoadLayer", "each entry of `layers`"))
"""The sections of a ``load.jsonl`` line (:mod:`atlas_tracking.schema.load`) in the order the docs list them."""


ROLLOUT_SECTIONS = (("RolloutLine", "a line of `rollout.jsonl`"), ("RolloutLayer", "each entry of `layers`"))
"""The sections of a ``rollout.jsonl`` line (:mod:`atlas_tracking.schema.rollout`) in the order the docs list them."""


def load_fields() -> str:
    """One table per section of a ``load.jsonl`` line: field, type, meaning.

    >>> print(load_fields().splitlines()[7])
    | `step` | `int` | The last optimizer step of the interval (the line's key). |
    """
    return line_fields(load_schema, LOAD_SECTIONS)


def rollout_fields() -> str:
    """One table per section of a ``rollout.jsonl`` line: field, type, meaning.

    >>> print(rollout_fields().splitlines()[7])
    | `step` | `int` | The optimizer step the rollout was trained on (the line's key). |
    """
    return line_fields(rollout_schema, ROLLOUT_SECTIONS)


def line_fields(module: Any, sections: tuple[tuple[str, str], ...]) -> str:
    """One table per ``TypedDict`` section of ``module`` (name, where it sits in the line): field, type, meaning."""
    parts = []
    for name, where in sections:
        cls = getattr(module, name)
        hints, docs = typing.get_type_hints(cls, vars(module)), attribute_docs(cls)
        rows = [[f"`{key}`", f"`{_type_text(tp)}`", docs.get(key, "")] for key, tp in hints.items()]
        doc = " ".join((inspect.getdoc(cls) or "").split())
        parts.append(f"### {name} ({where})\n\n{doc}\n\n" + _table(["field", "type", "meaning"], rows))
    return "\n\n".join(parts)


# --- tracker keys -------------------------------------------------------------------------------------

DERIVED_METRICS = {
    "verdict_code": "The gate's one verdict as a number, what the report's badge, MLflow's `atlas.verdict` and W&B's "
    "`atlas/verdict` show (docs/policy.md#the-verdict): " + code_legends()["atlas/verdict_code"] + ".",
    "status_code": "The receipt-level status (Table 11's reading of C2, occupancy and the objective) as a number: "
    + ", ".join(f"{s.value} {s.code}" for s in Status) + ". Not the verdict: a YELLOW gate in `intervene` plots 2 "
    "here and 3 in `verdict_code`.",
    "stage_code": "The stage as a number: " + ", ".join(f"{s.value} {s.code}" for s in Stage) + ".",
    "ov_cf_cliff_off_terminal": "1 when the dominant `ov_cf` cliff is not at the terminal routed layer, else 0.",
    "predicate/protected_rewrite": "Post-training: the protected-atlas rewrite predicate as a number: "
    + ", ".join(f"{v} {c}" for v, c in VERDICT_CODES.items()) + ".",
    "predicate/base_damage": "Post-training: the base-domain damage predicate as a number: "
    + ", ".join(f"{v} {c}" for v, c in VERDICT_CODES.items()) + ".",
}
"""Tracker keys computed from a record rather than copied from one field."""

LOAD_KIND = "training batches, per interval"
ROLLOUT_KIND = "rollout agreement, per recorded step"
PICTURE_KIND = "training batches, every `telemetry.picture_every` intervals"

RANKED_METRICS = {
    "top1_expert": "The worst layer's i-th busiest expert in the interval (its index in the layer; ties go to the "
    "lower index), i = 1 to `telemetry.top_experts`.",
    "top1_share": "That busiest expert's share of the worst layer's routes in the interval (4 digits).",
    "bottom1_expert": "The worst layer's i-th idlest expert in the interval (its index in the layer; ties go to the "
    "lower index), i = 1 to `telemetry.top_experts`.",
    "bottom1_share": "That idlest expert's share of the worst layer's routes in the interval (4 digits).",
}
"""The meaning of each per-expert key of :func:`~atlas_tracking.schema.load.ranked_keys`, by its first rank's name
(the table writes ``<i>`` for the rank)."""

PICTURE_KEYS = {
    "train/experts": "W&B table: one row per routed layer and expert of the interval (step, layer, name, expert, "
    "routes, share, dead). MLflow receives the interval's line as the artifact `atlas/load/step_<step>.json`.",
    "train/expert_load": "W&B image: the layers x experts picture of the interval's routes. MLflow receives it as the "
    "artifact `atlas/figures/train_expert_load_<step>.png`.",
}
"""The training-batch table and picture, sent with every ``telemetry.picture_every``-th interval (never scalars)."""


def load_keys() -> list[list[str]]:
    """The tracker-key rows of the training-batch load between gates: the bounded summary, the worst layer's ranked
    experts and the picture; nothing per layer, whatever the model's depth and width.

    >>> for row in load_keys()[-6:]:
    ...     print(row[0], "|", row[1])
    `atlas/train/top<i>_expert` | training batches, per interval
    `atlas/train/top<i>_share` | training batches, per interval
    `atlas/train/bottom<i>_expert` | training batches, per interval
    `atlas/train/bottom<i>_share` | training batches, per interval
    `atlas/train/experts` | training batches, every `telemetry.picture_every` intervals
    `atlas/train/expert_load` | training batches, every `telemetry.picture_every` intervals
    """
    docs = attribute_docs(load_schema.LoadSummary)
    rows = [[f"`{key}`", LOAD_KIND, docs.get(name, "")] for name, key in load_schema.SUMMARY_KEYS.items()]
    for key in load_schema.ranked_keys(1):
        rank = key.rsplit("/", 1)[1]
        rows.append(["`" + re.sub(r"(top|bottom)1_", r"\1<i>_", key) + "`", LOAD_KIND, RANKED_METRICS[rank]])
    rows += [[f"`atlas/{key}`", PICTURE_KIND, text] for key, text in PICTURE_KEYS.items()]
    return rows


def tracker_keys() -> str:
    """Every key a tracker receives, where it comes from and what it means."""
    docs = {**attribute_docs(record_schema.Summary), **attribute_docs(record_schema.Margins),
            **attribute_docs(record_schema.BaseDamage), **attribute_docs(record_schema.CoMovement),
            **attribute_docs(record_schema.Gate)}
    rows: list[list[str]] = []
    for cls, kind in ((record_schema.Summary, "summary"), (record_schema.Gate, "gate"),
                      (record_schema.Margins, "against the baseline"), (record_schema.BaseDamage, "against the baseline"),
                      (record_schema.CoMovement, "against the baseline")):
        for key, name in metric_fields(cls).items():
            unit = " (load CV x 100)" if key in METRIC_NAMES else ""
            rows.append([f"`atlas/{name}`", kind, docs.get(key, "") + unit])
    rows += [[f"`atlas/{key}`", "decision", text] for key, text in DERIVED_METRICS.items()]
    groups = ", ".join(PARAM_GROUPS)
    rows.append(["`atlas/param_drift/<group>`", "against the baseline",
                 f"Relative L2 distance of a module group's parameters ({groups}, and `total`)."])
    rows.append(["`atlas/param_drift/<group>_moved`", "against the baseline", "Elements of the group that moved."])
    layer_docs = attribute_docs(record_schema.LayerRecord)
    rows += [[f"`atlas/layer_NN/{key}`", "per routed layer", layer_docs.get(key, "")]
             for key in metric_fields(record_schema.LayerRecord)]
    rows += load_keys()
    docs = attribute_docs(rollout_schema.RolloutSummary)
    rows += [[f"`{key}`", ROLLOUT_KIND, docs.get(name, "")] for name, key in rollout_schema.SUMMARY_KEYS.items()]
    return _table(["key", "kind", "meaning"], rows)


# --- model families -----------------------------------------------------------------------------------


def _shared_text(row: Family) -> str:
    if row.shared is None:
        return "-"
    text = f"`{row.shared.module}`"
    return text + (f" x sigmoid(`{row.shared.gate}`)" if row.shared.gate else "")


NORM_NAMES = {"rms": "RMSNorm", "layernorm": "LayerNorm"}
"""A row's ``norm_type`` as the family table names it."""


def _norm_text(row: Family) -> str:
    """The pre-norm's kind and gain convention (docs/receipts.md#notation).

    >>> from atlas_tracking.adapters.families import FAMILIES
    >>> rows = {row.name: row for row in FAMILIES}
    >>> _norm_text(rows["mixtral"]), _norm_text(rows["qwen3_next"])
    ('RMSNorm', '(1+w) RMSNorm')
    """
    kind = NORM_NAMES[row.norm_type] if isinstance(row.norm_type, str) else "RMSNorm or LayerNorm (config)"
    return f"(1+w) {kind}" if row.gain == "1+w" else kind


def _top_k_text(row: Family) -> str:
    """The experts per token: the row's fixed number, or ``config`` where the model's config sets it."""
    return str(row.top_k) if isinstance(row.top_k, int) else "config"


def families() -> str:
    """The transformers family table: every family read exactly, then every family refused with its reason.

    Per family: the router's semantics, the experts per token (``k``), whether it has zero-computation experts,
    the pre-norm's kind and gain convention, and the shared experts.
    """
    rows = []
    for row in FAMILIES:
        notes = ["exact, tested"]
        if row.norm != "post_attention_layernorm":
            notes.append(f"pre-norm `{row.norm}`")
        if row.scale is not None:
            notes.append("block scales the routed sum")
        if row.model_types:
            notes.append("also " + ", ".join(f"`{t}`" for t in row.model_types))
        rows.append([f"`{row.name}`", ", ".join(f"`{b}`" for b in row.blocks), row.router.kind, _top_k_text(row),
                     "yes" if row.zero_experts else "no", _norm_text(row), _shared_text(row), "; ".join(notes)])
    aliases = {target: alias for alias, target in REFUSED_ALIASES.items()}
    for name, (blocks, why) in REFUSED.items():
        also = f" (also `{aliases[name]}`)" if name in aliases else ""
        rows.append([f"`{name}`", ", ".join(f"`{b}`" for b in blocks), "-", "-", "-", "-", "-",
                     f"refused{also}: {why}"])
    return _table(["family (model type)", "MoE block", "router semantics", "k", "zero experts", "norm",
                   "shared experts", "status"], rows)


GENERATORS: dict[str, Callable[[], str]] = {
    "configuration": configuration,
    "record-fields": record_fields,
    "load-fields": load_fields,
    "rollout-fields": rollout_fields,
    "tracker-keys": tracker_keys,
    "families": families,
    "interventions": recipes_table,
}
"""Placeholder name -> the function that makes its Markdown."""


def expand(markdown: str) -> str:
    """``markdown`` with every ``<!-- generated: NAME -->`` line replaced by its table; an unknown name is an error.

    >>> try:
    ...     expand("<!-- generated: nothing -->")
    ... except KeyError as exc:
    ...     print(exc.args[0].split("; ")[0])
    unknown generated section 'nothing'
    """
    out = []
    for line in markdown.splitlines():
        text = line.strip()
        if text.startswith("<!-- generated:") and text.endswith("-->"):
            name = text[len("<!-- generated:"):-len("-->")].strip()
            if name not in GENERATORS:
                raise KeyError(f"unknown generated section {name!r}; known: {', '.join(GENERATORS)}")
            out.append(GENERATORS[name]())
        else:
            out.append(line)
    return "\n".join(out) + ("\n" if markdown.endswith("\n") else "")
