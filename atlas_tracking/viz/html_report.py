"""``atlas-tracking report``: a self-contained HTML page (and PNGs) for a run or one receipts file.

For a run directory (``<run>/atlas/gates.jsonl``, read as one history with
:func:`atlas_tracking.artifacts.history.read_history`): an opening that names the gates failing since the last gate
that ran (``errors.jsonl``: step, reason, layers) before anything else, else the last gate with its badge; then, in
the same first section (:func:`first_screen`), why, where (the worst layers and the layers x experts picture) and
what to do (the first intervention with its lines); below it loss and C2 against step (the report's figure 4),
the three occupancy axes per layer over gates (dead experts, load CV, router entropy) with a per-layer table
from the baseline to the last gate, the last gate's layers x experts load heatmap and the experts it names
(docs/receipts.md#per-expert-load), the last gate's near-tie mass per layer (docs/receipts.md#near-tie-mass),
per-layer C2 of the last gate grouped early / protected / late (figure 5;
the groups follow each layer's ``protected`` flag, ``lifecycle.protected_layers``) and its change since the
baseline, the layers x gates heatmap of C2 change since the baseline, the stage timeline with alerts, the gate table, and the licensed / unlicensed claims of the last
gate. A run with ``load.jsonl`` also gets the training-batch load between gates (:func:`load_section`), a run with
``rollout.jsonl`` the rollout agreement of a reinforcement-learning loop (:func:`rollout_section`). For a
receipts artifact: the per-layer table (near-tie mass included) and C2 bars. Figures are embedded as base64 PNG;
the page loads nothing from the network. Needs matplotlib (``pip install 'atlas-tracking[report]'``).
"""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path
from typing import Any

from atlas_tracking.artifacts.expert_text import expert_lines, layer_label
from atlas_tracking.artifacts.gate_report import read_artifact
from atlas_tracking.artifacts.history import gates_file, read_history, read_lines
from atlas_tracking.artifacts.io import write_atomic
from atlas_tracking.artifacts.load_record import read_load
from atlas_tracking.artifacts.load_summary import expert_layers
from atlas_tracking.artifacts.receipts_file import FORMS
from atlas_tracking.artifacts.record import finite_number
from atlas_tracking.artifacts.rollout_record import read_rollout
from atlas_tracking.receipts.param_drift import drift_line
from atlas_tracking.receipts.state1 import NEAR_TIE_DTYPES
from atlas_tracking.schema.artifacts import ERRORS
from atlas_tracking.schema.load import SUMMARY_KEYS
from atlas_tracking.schema.record import FAILED
from atlas_tracking.schema.verdict import gate_verdict
from atlas_tracking.viz.coupling import coupling_section
from atlas_tracking.viz.docs_links import DocsLinks
from atlas_tracking.viz.figures import (
    STATUS_COLORS,
    TRAIN_LOAD,
    c2_change_row,
    fig_c2_heatmap,
    fig_expert_change,
    fig_expert_load,
    fig_layer_c2,
    fig_loss_c2,
    fig_occupancy,
    fig_timeline,
    fig_train_load,
    png_bytes,
)
from atlas_tracking.viz.first_screen import intervention_html, name_layers, worst_table
from atlas_tracking.viz.gate_table import format_cost, gate_cost
from atlas_tracking.viz.rollout import LAYER_HEADER, fig_rollout, first_mismatch_rows, layer_rows
from atlas_tracking.viz.tables import NA_TOP1, c2_cell, top1
from atlas_tracking.viz.train_load import load_view, no_grad_note


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return html.escape("-" if v is None else str(v))

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


HEATMAP_NOTE = ("Each layer's C2 change since its gate's baseline (C2 now minus at the baseline; 0 at a baseline "
                "gate): red where co-active experts became less compatible, blue where more, white where nothing "
                "changed, so a protected layer at its own baseline reads white.")
"""What the report says above the layers x gates heatmap."""

TOP1_NOTE = ("top-1 routing has no co-active pairs, so C2 and its changes are absent; occupancy, State1, drift and "
             "State3 carry the read (docs/policy.md#top-1-routing).")
"""What the report says where a C2 figure would be at top-1 routing."""

BADGE_COLORS = {**{s.value: c for s, c in STATUS_COLORS.items()}, FAILED: "#6c1010"}
"""The badge's colour per verdict level (:func:`~atlas_tracking.schema.verdict.gate_verdict`)."""

CSS = """body{font-family:system-ui,sans-serif;margin:1em 2em;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:12px;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 6px}
th{background:#f4f4f4}img{max-width:100%;display:block;margin:1em 0}.claims li{margin:.2em 0}
.status{font-weight:bold;padding:2px 6px;border-radius:3px;color:white}
#first-screen h1{margin:.2em 0}#first-screen h2{font-size:1.1em;margin:.6em 0 .2em}#first-screen p{margin:.3em 0}
.where{display:flex;gap:1em;align-items:flex-start}.where table{margin:0;flex:0 0 auto}
.where .pic{flex:1 1 0;min-width:0}.where img{margin:0;width:100%;height:auto}.layer{border-bottom:1px dotted #777}code.module{font-size:10px;color:#666}
.tag{font-size:10px;background:#e67e22;color:white;border-radius:3px;padding:0 3px}
.recipes{display:grid;grid-template-columns:1fr 1fr;gap:.3em .8em;margin-top:.3em}
.recipe pre{font-size:10.5px;background:#f6f6f6;padding:3px 5px;margin:.1em 0;white-space:pre-wrap}"""


NEAR_TIE_HEADER = [f"near-tie {name}" for name in NEAR_TIE_DTYPES]
NEAR_TIE_NOTE = ("The share of each layer's counted canary tokens whose set margin lies within the rounding of a tie at "
                 "bf16 / fp16, |m| <= eps (|s_k| + |s_k1|): routing decisions an engine ranking the scores in that "
                 "precision could make the other way. A first-order bound on the rounding, not a count of flips "
                 "(docs/receipts.md#near-tie-mass).")
"""What the report says above the near-tie table."""


def near_tie_cells(layer: dict[str, Any]) -> list[str]:
    """A layer's near-tie mass at each precision (docs/receipts.md#near-tie-mass) as ``share (tokens of counted)``,
    from a record's layer or a receipts artifact's layer receipts; ``-`` where it was not measured.

    >>> near_tie_cells({"near_tie": {"bf16": 0.0625, "fp16": 0.0}, "near_tie_tokens": {"bf16": 4, "fp16": 0,
    ...                 "counted": 64}}), near_tie_cells({})
    (['0.0625 (4 of 64)', '0 (0 of 64)'], ['-', '-'])
    """
    share, tokens = layer.get("near_tie") or {}, layer.get("near_tie_tokens") or {}
    return [f"{share[name]:.3g} ({tokens[name]} of {tokens['counted']})" if share.get(name) is not None else "-"
            for name in NEAR_TIE_DTYPES]


def near_tie_table(layers: list[dict[str, Any]]) -> str:
    """Per routed layer of a record, the State1 mean margin and the near-tie mass at each precision."""
    rows = [[layer_label(lay), lay.get("margin_mean"), *near_tie_cells(lay)] for lay in layers]
    return _table(["layer", "mean margin", *NEAR_TIE_HEADER], rows)


def cliff_text(d: dict[str, Any], profile: list[Any]) -> str:
    """One sentence on the terminal cliff of ``ov_cf`` (:mod:`atlas_tracking.receipts.cliff`) from a record or a
    receipts summary, and the note when the dominant cliff is not at the terminal routed layer.

    >>> cliff_text({"ov_cf_terminal_jump": -0.39, "ov_cf_terminal_jump_ci": [-0.41, -0.37], "ov_cf_terminal_ordinal": 2,
    ...             "ov_cf_adjacent_jump": -0.4, "ov_cf_adjacent_jump_ci": [-0.42, -0.38]}, [0.8, 0.7, 0.3])
    'ov_cf depth profile [0.8, 0.7, 0.3]; terminal jump (layer 2 minus the band before it) -0.39 CI [-0.41, -0.37]; adjacent jump -0.4 CI [-0.42, -0.38].'
    """
    def num(x: Any) -> str:
        return "-" if x is None else f"{x:.3g}"

    def ci(x: Any) -> str:
        return f"[{num(x[0])}, {num(x[1])}]" if x else "[-, -]"

    if d.get("ov_cf_terminal_ordinal") is None:
        return "ov_cf depth profile: fewer than two routed layers, no terminal jump."
    text = (f"ov_cf depth profile [{', '.join(num(v) for v in profile)}]; terminal jump (layer "
            f"{d['ov_cf_terminal_ordinal']} minus the band before it) {num(d.get('ov_cf_terminal_jump'))} CI "
            f"{ci(d.get('ov_cf_terminal_jump_ci'))}; adjacent jump {num(d.get('ov_cf_adjacent_jump'))} CI "
            f"{ci(d.get('ov_cf_adjacent_jump_ci'))}.")
    return text + (f" Note: {d['ov_cf_cliff_note']}." if d.get("ov_cf_cliff_note") else "")


def verdict_lines(last: dict[str, Any]) -> list[str]:
    """The last gate's verdicts in words: the rule its stage follows, the three predicates (post-training) or the
    handoff readiness and what it rests on (pretraining), and the base damage since the base and the baseline.

    >>> verdict_lines({"rule": "Table 13 row 1: first bad gate after a clean baseline", "predicates": {
    ...     "protected_rewrite": {"verdict": "pass", "reason": "refinement margin +0.2000 >= 0 on the protected layers"}}})
    ['Rule: Table 13 row 1: first bad gate after a clean baseline.', 'protected rewrite: pass (refinement margin +0.2000 >= 0 on the protected layers)']
    """
    out = [f"Rule: {last['rule']}."] if last.get("rule") else []
    for name, entry in (last.get("predicates") or {}).items():
        out.append(f"{name.replace('_', ' ')}: {entry.get('verdict')} ({entry.get('reason')})")
    handoff = last.get("handoff")
    if handoff:
        out.append(f"Handoff readiness: {'ready' if handoff.get('ready') else 'not ready'}; basis: "
                   f"{handoff.get('basis', 'stability')}" + (f"; {'; '.join(handoff['reasons'])}"
                                                            if handoff.get("reasons") else "") + ".")
    if last.get("kl_base_cumulative") is not None or last.get("canary_nll_delta_cumulative") is not None:
        def num(x: Any) -> str:
            return "n/a" if x is None else f"{x:+.4f}"

        out.append(f"Base damage since the base (step {last.get('base_step')}): KL {num(last.get('kl_base_cumulative'))}"
                   f", canary NLL {num(last.get('canary_nll_delta_cumulative'))}; since the baseline (step "
                   f"{last.get('baseline_step')}): KL {num(last.get('kl_base'))}, canary NLL "
                   f"{num(last.get('canary_nll_delta'))}.")
    return out


def expert_text(layers: list[dict[str, Any]]) -> str:
    """The dead and overloaded experts of each layer, or why there are none to name.

    >>> expert_text([{"index": 1, "expert_load": [5, 5]}]), expert_text([{"index": 1}])
    ('No dead or overloaded expert in any layer.', 'No per-expert loads recorded.')
    """
    if not any(lay.get("expert_load") for lay in layers):
        return "No per-expert loads recorded."
    return " ".join(expert_lines(layers)) or "No dead or overloaded expert in any layer."


def occupancy_table(recs: list[dict[str, Any]]) -> str:
    """Per routed layer, the three occupancy axes and C2 at the last gate's baseline and at the last gate
    (``baseline -> now``; the last gate alone when its baseline is not in ``recs``).

    >>> base = {"step": 0, "layers": [{"index": 2, "dead_experts": 0, "load_cv": 0.19, "router_entropy": 2.04}]}
    >>> last = {"step": 10, "baseline_step": 0, "layers": [{"index": 2, "dead_experts": 0, "load_cv": 1.06,
    ...                                                     "router_entropy": 1.48}]}
    >>> print(occupancy_table([base, last]).split("<tbody>")[1])
    <tr><td>layer 2</td><td>0 -&gt; 0</td><td>19 -&gt; 106</td><td>2.04 -&gt; 1.48</td><td>- -&gt; -</td></tr></tbody></table>
    """
    last = recs[-1]
    base = next((r for r in reversed(recs[:-1]) if r["step"] == last.get("baseline_step")), None)
    base_layers = {lay.get("name"): lay for lay in (base or {}).get("layers", [])}

    def num(x: Any, scale: float = 1.0, na: str = "-") -> str:
        v = finite_number(x)
        return na if v is None else f"{scale * v:.3g}"

    rows = []
    for lay in last.get("layers", []):
        b = base_layers.get(lay.get("name"))
        na = NA_TOP1 if lay.get("top_k") == 1 else "-"
        cells = (("dead_experts", 1.0, "-"), ("load_cv", 100.0, "-"), ("router_entropy", 1.0, "-"), ("c2", 1.0, na))
        rows.append([layer_label(lay)] + [(f"{num(b.get(k), s, n)} -> " if b else "") + num(lay.get(k), s, n)
                                          for k, s, n in cells])
    return _table(["layer", "dead experts", "load CV x100", "router entropy", "C2"], rows)


def failed_gate_line(failure: dict[str, Any]) -> str:
    """One failed gate (a line of ``errors.jsonl``) in words: step, reason, layers.

    >>> failed_gate_line({"step": 60, "error": "RouterLogitsError: NaN", "failed_layers": ["model.layers.1.mlp"]})
    'step 60: RouterLogitsError: NaN (layers: model.layers.1.mlp)'
    """
    layers = ", ".join(failure.get("failed_layers") or []) or "none named"
    return f"step {failure['step']}: {failure.get('error')} (layers: {layers})"


def opening(last: dict[str, Any], failures: list[dict[str, Any]]) -> str:
    """The report's first paragraph: the gates failing since the last gate that ran, when any (verdict FAILED),
    else the last gate with its verdict, the part that raised it and why
    (:func:`~atlas_tracking.schema.verdict.gate_verdict`); failed gates that a later gate cleared are named after it.

    >>> text = opening({"step": 50, "status": "GREEN", "stage": "clean"}, [{"step": 60, "error": "E: x"}])
    >>> text.split("</span>")[0].rsplit(">", 1)[1], "Gates failing since step 60" in text
    ('FAILED', True)
    """
    failing = [f for f in failures if f["step"] > last["step"]]
    cleared = [f for f in failures if f["step"] <= last["step"]]
    verdict = gate_verdict(last, failed=bool(failing), error=str(failing[-1].get("error")) if failing else "")
    word = verdict.level
    span = f'<span class="status" style="background:{BADGE_COLORS.get(word, "#555")}">{html.escape(word)}</span>'
    state = (f"step {last['step']} {html.escape(str(last.get('status')))}, stage "
             f"<b>{html.escape(str(last.get('stage')))}</b>")
    if failing:
        items = "".join(f"<li>{html.escape(failed_gate_line(f))}</li>" for f in failing)
        text = (f"<p>{span} Gates failing since step {failing[0]['step']}: {len(failing)} gate(s) could not run; the "
                f"policy's state is that of the last gate that ran ({state}).</p><ul>{items}</ul>")
    else:
        text = (f"<p>Last gate: {span} raised by <b>{html.escape(verdict.source)}</b>: {html.escape(verdict.reason)}"
                f" (step {last['step']}; status {html.escape(str(last.get('status')))}, stage "
                f"{html.escape(str(last.get('stage')))}). {html.escape(str(last.get('action', '')))}</p>")
    if cleared:
        items = "".join(f"<li>{html.escape(failed_gate_line(f))}</li>" for f in cleared)
        text += f"<p>{len(cleared)} earlier gate(s) could not run (cleared by a later gate):</p><ul>{items}</ul>"
    return text


def summary_rows(last: dict[str, Any]) -> list[list[Any]]:
    """The last interval's bounded summary (:func:`~atlas_tracking.viz.train_load.last_summary`) as table rows:
    field, tracker key, value; the worst layer's row names its module (shown as ``layer N`` by :func:`finish`).

    >>> for row in summary_rows({"worst_layer": 3, "worst_layer_name": "model.layers.3.mlp", "load_cv_max": 0.5}):
    ...     print(row)
    ['load_cv_max', 'atlas/train/load_cv_max', 0.5]
    ['worst_layer', 'atlas/train/worst_layer', 'model.layers.3.mlp']
    """
    rows = []
    for field, key in SUMMARY_KEYS.items():
        value = last.get(field)
        if field == "worst_layer" and value is not None:
            value = last.get("worst_layer_name") or f"layer {value}"
        if value is not None:
            rows.append([field, key, value])
    return rows


def load_section(lines: list[dict[str, Any]], recs: list[dict[str, Any]]) -> tuple[str, dict[str, bytes]]:
    """The report's section on the training-batch load between gates (docs/telemetry.md) for a run's ``load.jsonl``
    intervals and gate records: the per-layer figure over the intervals, the layers x experts picture of the last
    interval, its bounded summary, the alerts the intervals raised and the early gates; empty without intervals."""
    view = load_view(lines, recs)
    if view is None:
        return "", {}
    last = lines[-1]
    figures = {"train_load.png": png_bytes(fig_train_load(lines, recs)),
               "train_expert_load.png": png_bytes(fig_expert_load(expert_layers(last), last["step"], TRAIN_LOAD))}
    alerts = "".join(f"<li>step {a['step']} ({html.escape(str(a['level']))}): <b>{html.escape(str(a['title']))}</b>"
                     f" {html.escape(str(a['text']))}</li>" for a in view["alerts"])
    early = "".join(f"<li>step {g['step']}, read {html.escape(str(g['status']))} / {html.escape(str(g['stage']))}: "
                    f"{html.escape(str(g['trigger_reason'] or '-'))}</li>" for g in view["early_gates"])
    notes = "".join(f"<p>Steps {a}-{b}: no interval holds their routes (counted by processes gone before a "
                    "resume).</p>" for a, b in view["uncounted"])
    if (note := no_grad_note(view)) is not None:
        notes += f"<p>{html.escape(note)}.</p>"
    text = f"""<h2>Training-batch load between gates</h2>
<p>{view['intervals']} interval(s) of the routes the model's router chose in training, steps {view['first_step']}-\
{view['last_step']} (load.jsonl; docs/telemetry.md).</p>{notes}
{_img(figures['train_load.png'], 'training-batch load per layer between gates')}
{_img(figures['train_expert_load.png'], 'training-batch expert load at the last interval: layers x experts')}
<h3>Last interval (steps {view['last']['first_step']}-{view['last']['step']})</h3>
{_table(['summary', 'tracker key', 'value'], summary_rows(view['last']))}
<h3>Alarms (raised: WARN; cleared: INFO)</h3>{f'<ul class="alarms">{alerts}</ul>' if alerts else '<p>No interval raised an alarm.</p>'}
<h3>Early gates (trigger telemetry)</h3>{f'<ul class="early">{early}</ul>' if early else '<p>No early gate ran.</p>'}
"""
    return text, figures


ROLLOUT_NOTE = ("Per routed layer, the share of token positions the trainer's forward routed to another set of experts "
                "than the rollout engine did (mismatch), over the positions compared at each recorded step; the "
                "near-tie mass is the share whose trainer routing lies within that precision's rounding of a tie; "
                "fallback counts rollout routes that could not be replayed (docs/rollout.md#what-is-measured).")
"""What the report says above the rollout-agreement figure."""


def _logprob_text(lines: list[dict[str, Any]]) -> str:
    """The log-probabilities' mean absolute difference and k3 at the last step and averaged over the steps that
    have them; empty when no step has them."""
    rows = [line["logprobs"] for line in lines if (line.get("logprobs") or {}).get("tokens")]
    if not rows:
        return ""

    def mean(key: str) -> float:
        return sum(float(r[key]) for r in rows) / len(rows)

    return (f"<p>Log-probabilities of the rollout's tokens ({len(rows)} step(s)): mean absolute difference "
            f"{rows[-1]['abs_diff_mean']:.4g} at the last step ({mean('abs_diff_mean'):.4g} over the steps), k3 "
            f"{rows[-1]['k3']:.4g} ({mean('k3'):.4g}).</p>")


def rollout_section(lines: list[dict[str, Any]]) -> tuple[str, dict[str, bytes]]:
    """The report's section on the rollout agreement of a reinforcement-learning loop (docs/rollout.md) for a run's
    ``rollout.jsonl``: mismatch and bf16 near-tie mass per layer over the recorded steps, a per-layer table (mean
    and last mismatch, Jaccard, near-tie mass, fallback), the first-mismatch-layer counts, the log-probabilities'
    difference and the alerts; empty without a recorded step."""
    if not lines:
        return "", {}
    figures = {"rollout_agreement.png": png_bytes(fig_rollout(lines))}
    replayed = {bool(line.get("replayed")) for line in lines}
    replay = {frozenset([True]): "replayed", frozenset([False]): "not replayed"}.get(frozenset(replayed), "mixed")
    alerts = "".join(f"<li>step {line['step']} ({html.escape(str(a['level']))}): <b>{html.escape(str(a['title']))}"
                     f"</b> {html.escape(str(a['text']))}</li>" for line in lines for a in line.get("alerts") or [])
    text = f"""<h2>Rollout agreement</h2>
<p>{len(lines)} recorded step(s), steps {lines[0]['step']}-{lines[-1]['step']}, {lines[-1].get('tokens')} token \
positions at the last; routes {replay} in the update (rollout.jsonl; docs/rollout.md).</p>
<p>{html.escape(ROLLOUT_NOTE)}</p>
{_img(figures['rollout_agreement.png'], 'rollout agreement: mismatch per layer over steps')}
{_table(LAYER_HEADER, layer_rows(lines))}
<h3>First differing layer (token positions, every step)</h3>
{_table(['first differing layer', 'positions', 'share'], first_mismatch_rows(lines))}
{_logprob_text(lines)}<h3>Rollout alerts (raised: WARN; cleared: INFO)</h3>\
{f'<ul class="rollout-alerts">{alerts}</ul>' if alerts else '<p>No recorded step raised an alert.</p>'}
"""
    return text, figures


def why_html(last: dict[str, Any]) -> str:
    """Why the gate reads as it does: its interpretation, the rule its stage follows and the predicates that fail."""
    parts = [f"<i>{html.escape(str(last.get('interpretation') or ''))}</i>"] if last.get("interpretation") else []
    if last.get("rule"):
        parts.append(f"Rule: {html.escape(last['rule'])}.")
    failing = [f"{name.replace('_', ' ')} fails ({entry.get('reason')})"
               for name, entry in (last.get("predicates") or {}).items() if entry.get("verdict") == "fail"]
    parts += [f"{html.escape(text)}." for text in failing]
    return f'<p class="why"><b>Why:</b> {" ".join(parts) or "-"}</p>'


TAG = re.compile(r"(<[^>]*>)")
RAW = ("a", "pre", "code", "style", "title")
"""Elements whose text :func:`finish` leaves as it is (links already, configuration lines, module paths)."""


def finish(body: str, layers: list[dict[str, Any]], links: DocsLinks) -> str:
    """A page body with, in its text outside links and code, each docs reference and table row a link
    (:class:`~atlas_tracking.viz.docs_links.DocsLinks`) and each module path of a routed layer named by the
    model's layer number with the path on hover (:func:`~atlas_tracking.viz.first_screen.name_layers`).

    >>> links = DocsLinks("https://d.example/")
    >>> finish("<p>see docs/policy.md#the-judge; model.layers.1.mlp</p><pre>model.layers.1.mlp</pre>",
    ...        [{"name": "model.layers.1.mlp", "index": 1}], links)  # doctest: +NORMALIZE_WHITESPACE
    '<p>see <a href="https://d.example/policy/#the-judge">docs/policy.md#the-judge</a>;
     <span class="layer" title="model.layers.1.mlp">layer 1</span></p><pre>model.layers.1.mlp</pre>'
    """
    def keep(part: str) -> str:
        return part

    out, raw = [], 0
    for part in TAG.split(body):
        if part.startswith("<"):
            name = part.strip("</>").split()[0].lower() if part.strip("</>") else ""
            if name in RAW and not part.endswith("/>"):
                raw += -1 if part.startswith("</") else 1
            out.append(part)
        elif raw or not part:
            out.append(part)
        else:
            out.append(links.linked(part, escape=lambda text: name_layers(text, layers, escape=keep)))
    return "".join(out)


def first_screen(last: dict[str, Any], title: str, failures: list[dict[str, Any]], change_png: bytes,
                 links: DocsLinks) -> str:
    """The report's first screen (``<section id="first-screen">``), in order: the verdict and why, the worst
    layers with the layers x experts picture beside them, and the first intervention with its lines."""
    return f"""<section id="first-screen"><h1>{html.escape(title)}</h1>
{opening(last, failures)}
{why_html(last)}
<h2 id="where">Where: the worst layers at step {last['step']}</h2>
<div class="where">{worst_table(last)}<div class="pic">{_img(change_png, 'expert load change: layers x experts')}</div></div>
<h2 id="what-to-do">What to do</h2>{intervention_html(last, links)}
</section>"""


def cliff_html(last: dict[str, Any]) -> str:
    """The terminal cliff with its unit and meaning: the ``ov_cf`` profile per layer and the jumps."""
    layers = sorted(last.get("layers", []), key=lambda lay: lay.get("ordinal", 0))
    profile = [lay.get("ov_cf") for lay in layers]
    table = _table(["", *[layer_label(lay) for lay in layers]], [["ov_cf (share of k kept)", *profile]])
    return (f"<p>{html.escape(CLIFF_NOTE)}</p>{table}<p>{html.escape(cliff_text(last, profile))}</p>")


def drift_html(drift: dict[str, Any] | None) -> str:
    """Parameter drift per module group with its unit and meaning (or why there is none)."""
    if not drift:
        return "<p>No parameter drift recorded (a baseline gate, or gate.param_drift off).</p>"
    rows = [[group, f"{e['moved']:,} of {e['count']:,}", e.get("relative_distance"),
             "frozen" if e["moved"] == 0 else "moved"] for group, e in {**drift["groups"], "total": drift["total"]}.items()]
    return (f"<p>{html.escape(DRIFT_NOTE)} Since step {drift.get('reference_step', '-')}.</p>"
            + _table(["group", "parameters moved (of all)", "relative L2 distance", "reading"], rows)
            + f"<p><code>{html.escape(drift_line(drift))}</code></p>")


CLIFF_NOTE = ("ov_cf: the share of a token's k experts its router keeps after its own layer's update (0 to 1; 1: "
              "keeps all). The terminal jump is the last routed layer's ov_cf minus the mean of the band before it, "
              "in the same unit: negative is a cliff, the drop the last layer typically shows "
              "(docs/receipts.md#terminal-cliff).")
"""What the report says above the terminal cliff."""

DRIFT_NOTE = ("How far each parameter group moved from the weights kept at the baseline: the relative L2 distance "
              "||theta - theta_ref|| / ||theta_ref|| (0: unchanged; 1: moved as far as its own norm) and how many "
              "parameters differ at all. The secondary surface, read beside the atlas drift "
              "(docs/receipts.md#parameter-drift).")
"""What the report says above the parameter drift."""


def run_page(recs: list[dict[str, Any]], title: str, failures: list[dict[str, Any]] = (),
             load: list[dict[str, Any]] = (), rollout: list[dict[str, Any]] = (),
             docs_url: str | None = None) -> tuple[str, dict[str, bytes]]:
    """The HTML page and its figures for a run's gate records, its failed gates (``errors.jsonl``), its
    training-batch load intervals (``load.jsonl``) and its rollout agreement (``rollout.jsonl``); docs links
    point under ``docs_url`` (:class:`~atlas_tracking.viz.docs_links.DocsLinks`)."""
    last = recs[-1]
    links = DocsLinks.resolve(docs_url)
    figures = {
        "loss_c2.png": png_bytes(fig_loss_c2(recs)),
        "occupancy.png": png_bytes(fig_occupancy(recs)),
        "expert_load.png": png_bytes(fig_expert_load(last.get("layers", []), last["step"])),
        "expert_change.png": png_bytes(fig_expert_change(last.get("layers", []), last["step"])),
        "stage_timeline.png": png_bytes(fig_timeline(recs)),
    }
    if not top1(last):
        figures.update({
            "layer_c2.png": png_bytes(fig_layer_c2(
                last.get("layers", []), f"Per-layer C2 at step {last['step']} (early / protected / late)")),
            "layer_c2_delta.png": png_bytes(fig_layer_c2(
                last.get("layers", []), f"Per-layer change of C2 since the baseline (step {last.get('baseline_step')})",
                key="c2_delta")),
            "c2_heatmap.png": png_bytes(fig_c2_heatmap([(r["step"], c2_change_row(r)) for r in recs],
                                                       [layer_label(lay) for lay in last.get("layers", [])])),
        })
        layer_c2 = (f"{_img(figures['layer_c2.png'], 'per-layer C2')}\n"
                    f"{_img(figures['layer_c2_delta.png'], 'per-layer change of C2 since the baseline')}")
        heatmap = (f"<p>{html.escape(HEATMAP_NOTE)}</p>"
                   + _img(figures["c2_heatmap.png"], "C2 heatmap: layers x gates"))
    else:
        layer_c2 = heatmap = f"<p>{NA_TOP1}: {html.escape(TOP1_NOTE)}</p>"
    rows = [[r["step"], r.get("loss"), c2_cell(r.get("c2"), top1(r)), r.get("dead_experts"), r.get("min_entropy"), r.get("mean_cv"),
             r.get("margin"), r.get("status"), r.get("stage"), "; ".join(a["title"] for a in r.get("alerts", []))]
            for r in recs]
    licensed = "".join(f"<li>{html.escape(c)}</li>" for c in last.get("licensed", []))
    unlicensed = "".join(f"<li>{html.escape(c)}</li>" for c in last.get("unlicensed", []))
    load_html, load_figures = load_section(list(load), recs)
    figures.update(load_figures)
    rollout_html, rollout_figures = rollout_section(list(rollout))
    figures.update(rollout_figures)
    coupling_html, coupling_figures = coupling_section(last, _img)
    figures.update(coupling_figures)
    body = f"""{first_screen(last, title, list(failures), figures['expert_change.png'], links)}
<h2>Verdicts (last gate)</h2><ul>{''.join(f"<li>{html.escape(line)}</li>" for line in verdict_lines(last))}</ul>
<h2>Loss and C2</h2>{_img(figures['loss_c2.png'], 'loss and C2 against step')}
<h2>Occupancy per layer</h2>{_img(figures['occupancy.png'], 'dead experts, load CV and router entropy per layer')}
{occupancy_table(recs)}
<h2>Expert load (last gate)</h2>{_img(figures['expert_load.png'], 'expert load: layers x experts')}
<p>{html.escape(expert_text(last.get('layers', [])))}</p>
{coupling_html}
{load_html}{rollout_html}<h2>Per-layer C2 (last gate)</h2>{layer_c2}
<h2>C2: layers x gates</h2>{heatmap}
<h2>Terminal cliff (last gate)</h2>{cliff_html(last)}
<h2>State1: near-tie mass (last gate)</h2><p>{html.escape(NEAR_TIE_NOTE)}</p>{near_tie_table(last.get('layers', []))}
<h2>Parameter drift (last gate, the secondary surface)</h2>{drift_html(last.get('param_drift'))}
<h2>Stages and alerts</h2>{_img(figures['stage_timeline.png'], 'stage timeline')}
<h2>Claims of the last gate</h2><div class="claims"><b>Licensed</b><ul>{licensed}</ul>
<b>Not licensed</b><ul>{unlicensed}</ul>First intervention: <a href="#what-to-do">on the first screen</a>.</div>
<h2>Gates</h2>{_table(['step', 'loss', 'c2', 'dead', 'min H', 'cv', 'margin', 'status', 'stage', 'alerts'], rows)}
{f"<p>{html.escape(format_cost(cost))}</p>" if (cost := gate_cost(recs)) else ""}"""
    return _page(title, finish(body, last.get("layers", []), links)), figures


def receipts_page(data: dict[str, Any], title: str) -> tuple[str, dict[str, bytes]]:
    """The HTML page for one receipts artifact."""
    layers = [{"name": lay["name"], "protected": lay.get("protected"), **lay["receipts"]} for lay in data["layers"]]
    is_top1 = top1(data["summary"])
    figures = {} if is_top1 else {
        "layer_c2.png": png_bytes(fig_layer_c2(layers, "Per-layer C2 (early / protected / late)"))}
    keys = ["dead_experts", "load_cv", "router_entropy", "margin_mean", "c2", "v2_c1", "v2_c2", "ov_cf"]
    rows = [[lay["name"]] + [c2_cell(lay.get(k), is_top1) if k == "c2" else lay.get(k) for k in keys]
            + near_tie_cells(lay) for lay in layers]
    cliff = html.escape(cliff_text(data["summary"], data["summary"].get("ov_cf_profile") or []))
    c2 = f"<p>C2: {NA_TOP1}: {html.escape(TOP1_NOTE)}</p>" if is_top1 else _img(figures["layer_c2.png"], "per-layer C2")
    body = (f"<h1>{html.escape(title)}</h1>{c2}<p>{cliff}</p>"
            f"{_table(['layer', *keys, *NEAR_TIE_HEADER], rows)}"
            f"<pre>{html.escape(json.dumps(data['summary'], indent=1))}</pre>")
    return _page(title, body), figures


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body>{body}</body></html>")


def write_report(source: str | Path, out: str | Path, png_dir: str | Path | None = None,
                 docs_url: str | None = None) -> Path:
    """Write the HTML report for a run directory or a receipts artifact (``.json`` or ``.safetensors``; and the
    PNGs when asked); its docs links point under ``docs_url`` (:class:`~atlas_tracking.viz.docs_links.DocsLinks`)."""
    source = Path(source)
    if source.suffix in FORMS:  # a receipts artifact in either form, also one that is gone (its error says why)
        page, figures = receipts_page(read_artifact(source), f"atlas receipts: {source.name}")
    else:
        errors = gates_file(source).with_name(ERRORS)
        page, figures = run_page(read_history(source), f"atlas run: {source.name}",
                                 read_lines(errors) if errors.is_file() else [], read_load(errors.parent),
                                 read_rollout(errors.parent), docs_url)
    if png_dir is not None:
        png_dir = Path(png_dir)
        png_dir.mkdir(parents=True, exist_ok=True)
        for name, png in figures.items():
            (png_dir / name).write_bytes(png)
    return write_atomic(Path(out), page)




