"""What a gate says first, in the report and at the top of ``atlas-tracking gates``: where (the worst layers, by
the model's own layer numbers, and the experts involved) and what to do (the first intervention with the
lines that carry it out, docs/policy.md#first-interventions).

The worst layers are ordered by their C2 change since the baseline (most negative first), then by the
dead experts they gained; a gate without deltas (a baseline) is ordered by dead experts, then load CV.

Example:
    >>> last = {"step": 10, "layers": [
    ...     {"name": "model.layers.0.mlp", "index": 0, "c2": 0.12, "c2_delta": 0.01, "dead_experts": 0,
    ...      "load_cv": 0.3, "expert_load": [5, 5, 6, 4]},
    ...     {"name": "model.layers.1.mlp", "index": 1, "protected": True, "c2": 0.05, "c2_delta": -0.04,
    ...      "dead_experts": 2, "dead_experts_delta": 2.0, "load_cv": 1.1, "expert_load": [0, 0, 12, 8]}]}
    >>> [row["layer"] for row in worst_layers(last)]
    ['layer 1', 'layer 0']
    >>> print(where_line(last))
    where: layer 1 (protected): C2 -0.04 since the baseline, dead experts 2 (+2): 0, 1; layer 0: C2 +0.01 since the baseline, dead experts 0
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from typing import Any

from atlas_tracking.artifacts.expert_text import MAX_LAYERS, layer_label
from atlas_tracking.artifacts.record import finite_number
from atlas_tracking.receipts.experts import OVERLOAD_FACTOR, bounded_list, dead_experts, overloaded_experts
from atlas_tracking.schema.interventions import FRAMEWORKS, recipe_for
from atlas_tracking.schema.verdict import gate_verdict
from atlas_tracking.viz.docs_links import DocsLinks
from atlas_tracking.viz.tables import NA_TOP1

MODULE_PATH = re.compile(r"\b[A-Za-z_]\w*(?:\.\w+)*\.\d+(?:\.[A-Za-z_]\w*)+\b")
"""A dotted module path with a numbered block (``model.model.layers.3.mlp``)."""


def _order(lay: dict[str, Any]) -> tuple[float, float, float]:
    delta = finite_number(lay.get("c2_delta"))
    return (float("inf") if delta is None else delta, -(finite_number(lay.get("dead_experts_delta")) or 0.0),
            -(finite_number(lay.get("dead_experts")) or 0.0) - 1e-3 * (finite_number(lay.get("load_cv")) or 0.0))


def worst_layers(last: dict[str, Any], n: int = MAX_LAYERS) -> list[dict[str, Any]]:
    """The ``n`` worst routed layers of a gate record: each with its label (``layer N``), module path, protected
    flag, C2 and its change since the baseline, dead experts (count, change, ids), overloaded experts and load CV."""
    rows = []
    for lay in sorted(last.get("layers", []), key=_order)[:n]:
        loads = lay.get("expert_load") or []
        rows.append({"layer": layer_label(lay), "module": lay.get("name"), "protected": bool(lay.get("protected")),
                     "top1": lay.get("top_k") == 1, "c2": lay.get("c2"), "c2_delta": lay.get("c2_delta"),
                     "dead": lay.get("dead_experts"), "dead_delta": lay.get("dead_experts_delta"),
                     "dead_ids": dead_experts(loads) if loads else [],
                     "overloaded_ids": overloaded_experts(loads, OVERLOAD_FACTOR) if loads else [],
                     "load_cv": lay.get("load_cv")})
    return rows


def _signed(x: Any, fmt: str = "+.3g") -> str:
    v = finite_number(x)
    return "-" if v is None else format(v, fmt)


def _dead_text(row: dict[str, Any]) -> str:
    if row["dead"] is None:
        return "-"
    change = f" ({_signed(row['dead_delta'], '+.0f')})" if finite_number(row["dead_delta"]) is not None else ""
    ids = f": {bounded_list(row['dead_ids'])}" if row["dead_ids"] else ""
    return f"{finite_number(row['dead']):.0f}{change}{ids}"


def where_line(last: dict[str, Any], n: int = 2) -> str:
    """One line naming the ``n`` worst layers with their C2 change and dead experts (``atlas-tracking gates``)."""
    parts = []
    for row in worst_layers(last, n):
        c2 = NA_TOP1 if row["top1"] else f"C2 {_signed(row['c2_delta'])} since the baseline"
        prot = " (protected)" if row["protected"] else ""
        parts.append(f"{row['layer']}{prot}: {c2}, dead experts {_dead_text(row)}")
    return "where: " + ("; ".join(parts) if parts else "no routed layer recorded")


def what_lines(last: dict[str, Any]) -> list[str]:
    """The first intervention in words and where its configuration lines are (``atlas-tracking gates``)."""
    text = last.get("intervention")
    if not text:
        return [f"what to do: {last.get('action') or 'nothing asked at this gate'}"]
    lines = [f"what to do: {text}"]
    if recipe_for(text):
        lines.append("  the lines for Lightning, the transformers Trainer, DeepSpeed and Megatron-Core: "
                     "atlas-tracking report RUN, or docs/policy.md#first-interventions")
    return lines


def first_lines(last: dict[str, Any]) -> list[str]:
    """The top of ``atlas-tracking gates``: the last gate's verdict and why, where (:func:`where_line`) and what to
    do (:func:`what_lines`)."""
    why = "; ".join(x.rstrip(".") for x in (last.get("interpretation"), last.get("rule")) if x)
    return [f"verdict: {gate_verdict(last).headline()} at step {last['step']} (status {last.get('status')}, "
            f"stage {last.get('stage')})"
            + (f": {why}" if why else ""), where_line(last), *what_lines(last)]


def name_layers(text: str, layers: list[dict[str, Any]], escape: Callable[[str], str] = html.escape) -> str:
    """``text`` through ``escape`` with each module path of a routed layer shown as the model's layer number
    (``layer N``, the path on hover); a path followed by its own ``(layer N)`` is named once.

    >>> name_layers("worst layer model.model.layers.2.mlp (layer 2); x < 1", [{"name": "model.model.layers.2.mlp",
    ...             "index": 2}])
    'worst layer <span class="layer" title="model.model.layers.2.mlp">layer 2</span>; x &lt; 1'
    """
    labels = {lay.get("name"): layer_label(lay) for lay in layers}
    out, pos = [], 0
    for m in MODULE_PATH.finditer(text):
        path = m.group(0)
        label = labels.get(path) or next((lab for name, lab in labels.items() if (name and name.endswith("." + path))
                                          or path.endswith("." + str(name))), None)
        if label is None:
            label = layer_label({"name": path})
        end = m.end()
        if text.startswith(f" ({label})", end):
            end += len(f" ({label})")
        out.append(escape(text[pos:m.start()]))
        out.append(f'<span class="layer" title="{html.escape(path)}">{html.escape(label)}</span>')
        pos = end
    return "".join(out) + escape(text[pos:])


def layer_cell(row: dict[str, Any]) -> str:
    """A worst-layer row's first cell: ``layer N`` with the module path on hover, and whether it is protected."""
    prot = ' <span class="tag">protected</span>' if row["protected"] else ""
    return (f'<span class="layer" title="{html.escape(str(row["module"]))}">{html.escape(row["layer"])}</span>{prot}'
            f'<br><code class="module">{html.escape(str(row["module"]))}</code>')


def worst_table(last: dict[str, Any]) -> str:
    """The worst layers as an HTML table (``class="worst-layers"``), one row per layer."""
    head = ("<tr><th>layer</th><th title='C2 now minus at the baseline; negative: co-active experts less "
            "compatible'>C2 change (now)</th><th title='experts with no route on the canary: count (change since "
            "the baseline): ids'>dead experts</th><th title='experts above 2x the uniform share of routes'>"
            "overloaded</th><th title='coefficient of variation of the expert loads, x100; 0 = perfectly balanced'>"
            "load CV x100</th></tr>")
    body = []
    for row in worst_layers(last):
        c2 = NA_TOP1 if row["top1"] else f"{_signed(row['c2_delta'])} ({_signed(row['c2'], '.3g')})"
        cv = finite_number(row["load_cv"])
        body.append(f'<tr data-layer="{html.escape(row["layer"])}"><td>{layer_cell(row)}</td><td>{html.escape(c2)}'
                    f"</td><td>{html.escape(_dead_text(row))}</td><td>"
                    f"{html.escape(bounded_list(row['overloaded_ids']) if row['overloaded_ids'] else 'none')}</td>"
                    f"<td>{'-' if cv is None else f'{100 * cv:.3g}'}</td></tr>")
    return f'<table class="worst-layers"><thead>{head}</thead><tbody>{"".join(body)}</tbody></table>'


def intervention_html(last: dict[str, Any], links: DocsLinks) -> str:
    """The first intervention as an action (``class="intervention"``) with, per framework, the lines that carry it
    out; the worst protected layers the policy names fill in ``WORST_LAYERS``. Without an intervention, the
    stage's action."""
    text = last.get("intervention")
    ref = links.a("docs/policy.md#first-interventions", "docs/policy.md#first-interventions")
    if not text:
        return (f'<div class="intervention"><b>What to do:</b> {html.escape(str(last.get("action") or "-"))} '
                f"(no first intervention at this gate; {ref})</div>")
    recipe = recipe_for(text)
    if recipe is None:
        return f'<div class="intervention"><b>First intervention:</b> {html.escape(text)} ({ref})</div>'
    names = [layer_label(w) for w in last.get("worst_layers") or []]
    numbers = "[" + ", ".join(n.split()[-1] for n in names if n.startswith("layer ")) + "]"
    blocks = "".join(f'<div class="recipe"><b>{html.escape(name)}</b><pre>'
                     f"{html.escape(recipe.lines[name].replace('WORST_LAYERS', numbers))}</pre></div>"
                     for name in FRAMEWORKS)
    return (f'<div class="intervention"><b>First intervention ({html.escape(recipe.pattern.replace("_", " "))}):'
            f"</b> {html.escape(text)} ({ref})<div class=\"recipes\">{blocks}</div></div>")
