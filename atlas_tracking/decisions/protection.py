"""``protected_layers: auto``: the protected layer set, chosen once per run from its recorded gates and then
held fixed (docs/policy.md#protected-layers).

The measurement contract fixes a probe family and a protected layer set, so the set never moves inside a
live run. Section 8.8: protect the mid-band layers with the worst C2 sensitivity and the highest
specialization persistence. From the run's history (:func:`~atlas_tracking.artifacts.history.read_history`),
per routed layer:

- **C2 loss** (sensitivity) = the median, over the evidence gates, of ``-c2_delta`` (the recorded per-layer
  C2 change against the gate's reference; larger is worse). The median is robust to one odd gate.
- **persistence** = the median, over the same gates, of the fraction of the layer's experts that still
  receive canary tokens (``experts_active / num_experts``): a layer whose experts stay alive keeps its
  specialized experts (Table 8's dead-experts column); a layer whose experts went dead has little left
  to protect.

The rule:

1. Candidates: the mid band ``lifecycle.auto_band = [lo, hi]``, fractions of routed-layer depth. Routed
   layer ``i`` of ``n`` has depth ``i / (n - 1)`` (the first 0, the last 1); the candidates are the layers
   with ``lo <= i / (n - 1) <= hi``, i.e. ordinals ``ceil(lo (n - 1))`` to ``floor(hi (n - 1))``. For 27
   routed layers and the default ``[0.25, 0.75]``: ``0.25 x 26 = 6.5 -> 7`` and ``0.75 x 26 = 19.5 -> 19``,
   ordinals 7-19 (layers 8-20 counting from one: Table 8's mid band). Damage outside the band (early or
   late layers) never enters the set. When no routed layer lies in the band (fewer than three routed
   layers with the default band, or a narrow band), the candidates are the layers nearest the band's
   middle (both of two routed layers, the one of one).
2. A candidate is *persistent* when its persistence is at least ``lifecycle.auto_persistence_floor``.
3. Ranking: persistent before not persistent, then larger C2 loss, then larger persistence, then the
   smaller ordinal (so ties are broken by ordinal and the order of the records never matters).
4. Size: half the candidates, rounded up (7 of the 13 for 27 routed layers).
5. Once per run: until evidence exists the set is ``mid`` and the record says so
   (``protected_source: "mid (no evidence yet: ...)"``). It is chosen once, before the gate that first
   uses it: at the handoff (the first post-training gate of a run whose record was in pretraining; the
   evidence is the pretraining gates, each against the gate before it), or, in a run that is post-training
   from the start (or whose handoff had fewer pretraining gates than needed), once
   ``lifecycle.auto_min_gates`` post-baseline gates exist (the evidence is those gates). That gate's
   record holds the set, ``protected_source: "auto (chosen at step N from gates [...])"``, the evidence
   steps and, per layer, the numbers and reasons (``protection``). Every later gate uses exactly that set,
   read back from the run's record, so it survives resumes; later evidence never moves it.
6. A change is an event: a gate whose set differs from the previous gate's (the choice replacing ``mid``,
   a list the user adopted, a configuration changed between resumes) records ``protected_change`` with
   the old and new sets, the step and why. ``atlas-tracking protect RUN_DIR`` proposes a set from the whole
   record by the same rule and prints the configuration line that adopts it.

Example (8 routed layers, mid band ordinals 2-5, two chosen; the largest C2 damage is on layers 1, 6 and
7, outside the band; layer 3 lost most of its experts, so it ranks after every persistent layer):
    >>> ev = [{"ordinal": i, "name": f"l{i}", "c2_deltas": [d, d], "alive": [a, a]} for i, (d, a) in
    ...       enumerate(zip([-.3, -.5, -.1, -.08, 0, -.06, -.2, -.4], [1, 1, 1, .25, 1, 1, 1, 1]))]
    >>> out = choose(ev)
    >>> out["ordinals"], [(r["ordinal"], r["rank"]) for r in out["layers"] if r["candidate"]]
    ([2, 5], [(2, 1), (3, 4), (4, 3), (5, 2)])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from atlas_tracking.artifacts.history import HistoryError, gates_file, read_history, read_run_gates
from atlas_tracking.artifacts.record import finite_number
from atlas_tracking.receipts.lifecycle import protected_ordinals
from atlas_tracking.receipts.windows import TOP1
from atlas_tracking.schema.config import AtlasConfig, LifecycleConfig
from atlas_tracking.schema.record import Phase, Status

AUTO = "auto"
CHOSEN = "auto (chosen at step "
"""How the ``protected_source`` of a run's choice begins: the record the set is held from."""
_DEFAULTS = LifecycleConfig()
_EPS = 1e-9  # band edges that land on a layer's depth up to rounding (0.3 x 10) include it


class ProtectionError(ValueError):
    """A run's record gives no evidence to choose from (no post-baseline gate, mixed histories): exit code 2."""


def candidates(n_layers: int, band: Sequence[float] | None = None) -> list[int]:
    """The mid band: the routed layers whose depth ``i / (n - 1)`` lies in ``band`` (default
    ``lifecycle.auto_band``), else the layers nearest the band's middle.

    >>> c = candidates(27)
    >>> c[0], c[-1], len(c)
    (7, 19, 13)
    >>> candidates(8), candidates(4), candidates(2), candidates(1), candidates(8, (0.5, 0.55))
    ([2, 3, 4, 5], [1, 2], [0, 1], [0], [4])
    """
    lo, hi = _DEFAULTS.auto_band if band is None else band
    if n_layers <= 1:
        return list(range(n_layers))
    span = n_layers - 1
    inside = list(range(max(0, math.ceil(lo * span - _EPS)), min(span, math.floor(hi * span + _EPS)) + 1))
    if inside:
        return inside
    distance = [abs(i / span - (lo + hi) / 2) for i in range(n_layers)]
    return [i for i, d in enumerate(distance) if d <= min(distance) + _EPS]


def set_size(n_layers: int, band: Sequence[float] | None = None) -> int:
    """How many layers ``auto`` protects: half the candidates, rounded up.

    >>> set_size(27), set_size(8), set_size(4), set_size(2)
    (7, 2, 1, 1)
    """
    return math.ceil(len(candidates(n_layers, band)) / 2)


def _median(values: Sequence[Any]) -> float | None:
    finite = [v for v in (finite_number(x) for x in values) if v is not None]
    return float(np.median(finite)) if finite else None


def _key(row: dict[str, Any]) -> tuple:
    """Sort key, best first: persistent, larger C2 loss, larger persistence, smaller ordinal."""
    loss = row["c2_loss"] if row["c2_loss"] is not None else -math.inf
    persistence = row["persistence"] if row["persistence"] is not None else -math.inf
    return (not row["persistent"], -loss, -persistence, row["ordinal"])


def _fmt(x: float | None, spec: str = "+.4f") -> str:
    return "-" if x is None else format(x, spec)


def _band_text(band: Sequence[float]) -> str:
    return f"[{band[0]:g}, {band[1]:g}]"


def choose(
    evidence: Sequence[dict[str, Any]],
    *,
    band: Sequence[float] | None = None,
    persistence_floor: float = 0.5,
) -> dict[str, Any]:
    """The protected set from per-layer evidence (pure; the rule is in the module docstring).

    ``evidence``: one entry per routed layer with ``ordinal``, ``c2_deltas`` (per evidence gate) and
    ``alive`` (fraction of experts alive per gate), optionally ``name``; in any order. ``band``: the mid band
    (default ``lifecycle.auto_band``). Returns ``ordinals`` (sorted), ``candidates``, ``size`` and
    ``layers`` (per layer, by ordinal: ``c2_loss``, ``persistence``, ``persistent``, ``candidate``, ``rank``
    among the candidates, ``chosen``, ``reason``).
    """
    band = list(_DEFAULTS.auto_band if band is None else band)
    n = len(evidence)
    pool = candidates(n, band)
    rows = []
    for ev in sorted(evidence, key=lambda e: int(e["ordinal"])):
        o = int(ev["ordinal"])
        deltas = [finite_number(d) for d in ev["c2_deltas"]]
        loss = _median([-d for d in deltas if d is not None])
        persistence = _median(ev["alive"])
        rows.append({"ordinal": o, "name": ev.get("name", f"layer {o}"), "c2_loss": loss, "persistence": persistence,
                     "persistent": persistence is not None and persistence >= persistence_floor,
                     "candidate": o in pool, "gates": sum(d is not None for d in deltas), "rank": None})
    if sorted(r["ordinal"] for r in rows) != list(range(n)):
        raise ProtectionError(f"the evidence must hold routed-layer ordinals 0..{n - 1} once each")
    ranked = sorted((r for r in rows if r["candidate"]), key=_key)
    for i, r in enumerate(ranked, 1):
        r["rank"] = i
    size = set_size(n, band)
    chosen = {r["ordinal"] for r in ranked[:size]}
    for r in rows:
        r["chosen"] = r["ordinal"] in chosen
        r["reason"] = _reason(r, len(ranked), persistence_floor, band)
    return {"ordinals": sorted(chosen), "layers": rows, "candidates": pool, "size": size}


def _reason(row: dict[str, Any], n_candidates: int, floor: float, band: Sequence[float]) -> str:
    if not row["candidate"]:
        return f"outside the mid band {_band_text(band)}: not a candidate"
    persistence = (f"persistence {_fmt(row['persistence'], '.2f')}"
                   + ("" if row["persistent"] else f" (below the floor {floor:g})"))
    return (f"C2 loss {_fmt(row['c2_loss'])} (median over {row['gates']} gates), {persistence}; "
            f"rank {row['rank']} of {n_candidates} candidates")


# --- evidence from a run's records ----------------------------------------------------------------------


def _alive(layer: dict[str, Any]) -> float | None:
    e = finite_number(layer.get("num_experts"))
    if not e:
        return None
    active = finite_number(layer.get("experts_active"))
    if active is None:
        dead = finite_number(layer.get("dead_experts"))
        active = None if dead is None else e - dead
    return None if active is None else active / e


def post_baseline(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The gates that carry per-layer C2 deltas against a reference (every gate but baselines)."""
    return [r for r in records if r.get("status") != Status.BASELINE
            and any(lay.get("c2_delta") is not None for lay in r.get("layers", []))]


def evidence(records: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
    """Per-layer evidence (see :func:`choose`) from a history's post-baseline gates, and their steps.

    Raises :class:`ProtectionError` for a history that mixes canaries or routed-layer layouts.
    """
    prints = {r.get("canary_fingerprint") for r in records}
    if len(prints) > 1:
        raise ProtectionError(f"the history mixes canaries ({len(prints)} fingerprints): its C2 deltas are not "
                              "comparable; choose from the gates of one canary")
    layouts = {tuple(lay.get("name") for lay in r.get("layers", [])) for r in records}
    if len(layouts) > 1:
        raise ProtectionError(f"the history mixes routed-layer layouts ({len(layouts)} different layer lists)")
    gates = post_baseline(records)
    if not gates:
        return [], []
    names = [lay.get("name") for lay in gates[0]["layers"]]
    ev = [{"ordinal": i, "name": name, "c2_deltas": [g["layers"][i].get("c2_delta") for g in gates],
           "alive": [_alive(g["layers"][i]) for g in gates]} for i, name in enumerate(names)]
    return ev, [int(g["step"]) for g in gates]


def set_of(record: dict[str, Any]) -> list[int] | None:
    """The protected set a gate ran with: its ``protected_layers``, else its layers' ``protected`` flags
    (None when the record says neither)."""
    if "protected_layers" in record:
        return sorted(int(o) for o in record["protected_layers"])
    layers = record.get("layers") or []
    if not any("protected" in lay for lay in layers):
        return None
    return [int(lay.get("ordinal", i)) for i, lay in enumerate(layers) if lay.get("protected")]


def _yaml(setting: str | list[int]) -> str:
    return setting if isinstance(setting, str) else str(sorted(set(int(o) for o in setting)))


def _fallback(n_layers: int, why: str) -> dict[str, Any]:
    return {"ordinals": protected_ordinals(n_layers, "mid"), "source": f"mid (no evidence yet: {why})"}


def _top1(records: Sequence[dict[str, Any]]) -> bool:
    """The history's gates state that C2 is absent because of top-1 routing: there are no per-layer C2 deltas,
    so ``auto`` has nothing to rank and the set stays ``mid`` (docs/policy.md#top-1-routing).

    >>> _top1([{"c2_absent": "top-1 routing"}]), _top1([{"c2": 0.1}])
    (True, False)
    """
    return any(r.get("c2_absent") == TOP1 for r in records)


def _choose_once(records: Sequence[dict[str, Any]], n_layers: int, lifecycle: LifecycleConfig, step: int,
                 pretraining: bool, fingerprint: str | None) -> dict[str, Any]:
    """The choice at this gate when the record holds none yet (rule 5), or the ``mid`` fallback and why."""
    if pretraining:
        return _fallback(n_layers, "pretraining; the set is chosen at the handoff from the pretraining gates")
    same = [r for r in records if fingerprint is None or r.get("canary_fingerprint") == fingerprint]
    handoff = bool(records) and records[-1].get("phase") == Phase.pretraining
    pool = [r for r in same if (r.get("phase") == Phase.pretraining) == handoff]
    ev, steps = evidence(pool)
    need = lifecycle.auto_min_gates
    if not steps and _top1(pool):
        return {"ordinals": protected_ordinals(n_layers, "mid"),
                "source": "mid (top-1 routing: no per-layer C2 deltas to choose from)"}
    if len(steps) < need:
        return _fallback(n_layers, f"{len(steps)} of {need} {'pretraining' if handoff else 'post-baseline'} gates"
                                   + (" at the handoff" if handoff else ""))
    chosen = choose(ev, band=lifecycle.auto_band, persistence_floor=lifecycle.auto_persistence_floor)
    gates = f"the pretraining gates {steps}, at the handoff" if handoff else f"gates {steps}"
    return {"ordinals": chosen["ordinals"], "source": f"{CHOSEN}{int(step)} from {gates})", "evidence_steps": steps,
            "layers": chosen["layers"]}


def resolve(records: Sequence[dict[str, Any]], n_layers: int, lifecycle: LifecycleConfig, *, step: int,
            pretraining: bool = False, fingerprint: str | None = None) -> dict[str, Any]:
    """The protected set of the gate at ``step`` after ``records`` (the run's history on this routed-layer
    layout, oldest first), with what its record carries.

    ``pretraining``: the gate is read in pretraining (no choice before the handoff). ``fingerprint``: the
    canary whose gates are evidence (None: every record, which must then be of one canary). Returns
    ``auto`` (the setting is ``auto``), ``ordinals``, ``source`` (the held choice, the ``mid`` fallback and
    why, or the configured setting), ``evidence_steps``, ``layers`` (per-layer numbers and reasons, only at
    the gate that chooses) and ``change`` (from, to, step, reason when the set differs from the previous
    gate's, else None).
    """
    setting = lifecycle.protected_layers
    out: dict[str, Any] = {"auto": setting == AUTO, "evidence_steps": [], "layers": []}
    if setting != AUTO:
        out.update(ordinals=protected_ordinals(n_layers, setting),
                   source=f"config: lifecycle.protected_layers: {_yaml(setting)}")
    else:
        held = next((r for r in reversed(records) if str(r.get("protected_source", "")).startswith(CHOSEN)), None)
        if held is not None:
            out.update(ordinals=set_of(held), source=held["protected_source"],
                       evidence_steps=list(held.get("protected_evidence_steps") or []))
        else:
            out.update(_choose_once(records, n_layers, lifecycle, step, pretraining, fingerprint))
    before = set_of(records[-1]) if records else None
    out["change"] = None
    if before is not None and before != out["ordinals"]:
        after = records[-1].get("protected_source") or f"the set of the gate at step {records[-1].get('step')}"
        out["change"] = {"from": before, "to": out["ordinals"], "step": int(step),
                         "reason": f"{out['source']}, after {after}"}
    return out


def record_fields(resolved: dict[str, Any]) -> dict[str, Any]:
    """What a gate record carries of its set: with ``auto`` the set, its source and evidence steps (and the
    per-layer reasons at the choosing gate); with any setting, a change and the set it made."""
    out: dict[str, Any] = {}
    if resolved["auto"] or resolved["change"] is not None:
        out.update(protected_layers=resolved["ordinals"], protected_source=resolved["source"])
    if resolved["auto"]:
        out["protected_evidence_steps"] = resolved["evidence_steps"]
    if resolved["layers"]:
        out["protection"] = [{k: r[k] for k in ("ordinal", "c2_loss", "persistence", "rank", "chosen", "reason")}
                             for r in resolved["layers"]]
    if resolved["change"] is not None:
        out["protected_change"] = resolved["change"]
    return out


def for_gate(run_path: Path | None, canary_fingerprint: str, layer_names: list[str], lifecycle: LifecycleConfig,
             *, step: int, pretraining: bool = False) -> dict[str, Any]:
    """The protected set of a run's gate at ``step`` (:func:`resolve` on its history's gates of this layout;
    evidence from those on this canary).

    A record that cannot be read never stops a gate: with ``auto`` the set falls back to ``mid`` and the
    source says why; with another setting nothing is added to the record.
    """
    n = len(layer_names)
    try:
        records = read_history(run_path) if run_path is not None and _has_gates(run_path) else []
        records = [r for r in records if [lay.get("name") for lay in r.get("layers", [])] == layer_names]
        return resolve(records, n, lifecycle, step=step, pretraining=pretraining, fingerprint=canary_fingerprint)
    except (HistoryError, ProtectionError, OSError, KeyError, TypeError, ValueError) as exc:
        return {"auto": lifecycle.protected_layers == AUTO, "ordinals": protected_ordinals(n, "mid"),
                "source": f"mid (evidence unreadable: {exc})", "evidence_steps": [], "layers": [], "change": None}


def _has_gates(path: Path) -> bool:
    try:
        gates_file(path)
    except FileNotFoundError:
        return False
    return True


def protect(path: str | Path, config: AtlasConfig | None = None) -> dict[str, Any]:
    """A protected set proposed from a run's whole record (its atlas directory or ``gates.jsonl``) by the
    rule of ``auto``, beside the set in force at its last gate, and the configuration line that adopts it.

    Raises :class:`ProtectionError` when the record is missing or unreadable, mixes histories, or has
    fewer post-baseline gates than ``lifecycle.auto_min_gates``.
    """
    lc = (config or AtlasConfig()).lifecycle
    try:
        records, file = read_run_gates(path)
    except (HistoryError, OSError) as exc:
        raise ProtectionError(str(exc)) from None
    ev, steps = evidence(records)
    if len(steps) < lc.auto_min_gates:
        why = " (top-1 routing: its gates have no C2)" if _top1(records) else ""
        raise ProtectionError(f"{file} has {len(steps)} post-baseline gate(s) with per-layer C2 deltas{why}; "
                              f"choosing needs {lc.auto_min_gates} (lifecycle.auto_min_gates)")
    chosen = choose(ev, band=lc.auto_band, persistence_floor=lc.auto_persistence_floor)
    in_force = _in_force(records)
    adopt = None if in_force["ordinals"] == chosen["ordinals"] else f"lifecycle.protected_layers: {chosen['ordinals']}"
    return {"ordinals": chosen["ordinals"], "evidence_steps": steps, "layers": chosen["layers"],
            "candidates": chosen["candidates"], "size": chosen["size"], "band": list(lc.auto_band),
            "persistence_floor": lc.auto_persistence_floor, "in_force": in_force, "adopt": adopt,
            "gates_file": str(file), "n_layers": len(ev)}


def _in_force(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The set of the last gate and where it came from: the last recorded source when the set is still
    its set, else the gate's own ``protected`` flags."""
    last = records[-1]
    ordinals = set_of(last)
    named = next((r for r in reversed(records) if r.get("protected_source")), None)
    source = "the gate's protected layers"
    if named is not None and set_of(named) == ordinals:
        source = named["protected_source"] + ("" if named is last else f" (recorded at step {named['step']})")
    return {"step": int(last["step"]), "ordinals": ordinals, "source": source}


# --- command line -------------------------------------------------------------------------------------


def table(result: dict[str, Any]) -> str:
    """The proposal, the set in force and how to adopt; then the chosen layers first, the other candidates
    and the layers outside the band, each with its numbers."""
    in_force = result["in_force"]
    lines = [f"proposed protected layers: {result['ordinals']} of {result['n_layers']} routed layers, from the "
             f"post-baseline gates at steps {result['evidence_steps']}",
             f"  rule: the mid band {_band_text(result['band'])} of routed-layer depth (candidates "
             f"{result['candidates']}), persistent first (experts alive >= {result['persistence_floor']:g}), then "
             f"worst median C2 loss; {result['size']} layer{'' if result['size'] == 1 else 's'}",
             f"  in force at step {in_force['step']}: {in_force['ordinals']} ({in_force['source']})"]
    if result["adopt"] is None:
        lines.append("  nothing to adopt: the proposal is the set in force")
    else:
        lines.append(f"  to adopt it, set in the run's atlas config: {result['adopt']}  (the next gate records "
                     "protected_change)")
    lines.append(f"  {'':2} {'ord':>3}  {'layer':<28} {'C2 loss':>9} {'persist':>8} {'rank':>5}  reason")
    order = sorted(result["layers"], key=lambda r: (not r["chosen"], r["rank"] is None, r["rank"] or 0, r["ordinal"]))
    for r in order:
        lines.append(f"  {'*' if r['chosen'] else ' ':2} {r['ordinal']:>3}  {str(r['name'])[:28]:<28} "
                     f"{_fmt(r['c2_loss']):>9} {_fmt(r['persistence'], '.2f'):>8} {r['rank'] or '-'!s:>5}  "
                     f"{r['reason']}")
    return "\n".join(lines)
