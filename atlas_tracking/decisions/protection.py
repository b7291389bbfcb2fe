"""``protected_layers: auto``: the protected layer set chosen from a run's recorded gates (docs/policy.md#protected-layers).

Section 8.8: protect the mid-band layers with the worst C2 sensitivity and the highest specialization
persistence. From the run's history (:func:`~atlas_tracking.artifacts.history.read_history`), per routed layer:

- **C2 loss** (sensitivity) = the median, over the post-baseline gates, of ``-c2_delta`` (the recorded
  per-layer C2 change against the gate's baseline; larger is worse). The median is robust to one odd gate.
- **persistence** = the median, over the same gates, of the fraction of the layer's experts that still
  receive canary tokens (``experts_active / num_experts``): a layer whose experts stay alive keeps its
  specialized experts (Table 8's dead-experts column); a layer whose experts went dead has little left
  to protect.

The rule:

1. Candidates: the mid band = every routed layer but the two endpoints (the first and the last routed
   layer; section 8.8 names endpoint layers as surfaces adaptation should move first). With fewer than
   three routed layers every layer is a candidate.
2. A candidate is *persistent* when its persistence is at least ``lifecycle.auto_persistence_floor``.
3. Ranking: persistent before not persistent, then larger C2 loss, then larger persistence, then the
   smaller ordinal (so ties are broken by ordinal and the order of the records never matters).
4. Size: as ``mid`` (half the routed layers, rounded up), at most the number of candidates.
5. Hysteresis: once a set is chosen it is written to every gate record (``protected_layers``,
   ``protected_source: "auto"``), and the next gate starts from the last record's set. A member is
   replaced only when a candidate outside the set outranks it by more than ``lifecycle.auto_margin``
   (C2-loss units) or is persistent while the member is not; each swap is written to the record
   (``protected_change``) with both layers' numbers. So the same records always give the same set, and
   the set never changes silently from gate to gate.
6. Until ``lifecycle.auto_min_gates`` post-baseline gates exist (the baseline gate, a run with no
   history) the set is ``mid`` and the record says so: ``protected_source: "mid (no evidence yet: ...)"``.

Inside a run the set of a gate is chosen from the gates before it (it is needed before the gate measures
its lifecycle margins); ``atlas-tracking protect RUN_DIR`` prints the set the run's next gate would use.

Example (8 routed layers; C2 damage on layers 2, 3, 5 and 6 and on the endpoints 0 and 7, which are not
candidates; layer 6 lost most of its experts, so it ranks after every persistent layer):
    >>> ev = [{"ordinal": i, "name": f"l{i}", "c2_deltas": [d, d], "alive": [a, a]}
    ...       for i, (d, a) in enumerate(zip([-.3, 0, -.1, -.08, 0, -.06, -.2, -.4], [1, 1, 1, 1, 1, 1, .25, 1]))]
    >>> out = choose(ev)
    >>> out["ordinals"], [(r["ordinal"], r["rank"]) for r in out["layers"] if r["chosen"]]
    ([1, 2, 3, 5], [(1, 4), (2, 1), (3, 2), (5, 3)])
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
from atlas_tracking.schema.config import AtlasConfig, LifecycleConfig
from atlas_tracking.schema.record import Status

AUTO = "auto"


class ProtectionError(ValueError):
    """A run's record gives no evidence to choose from (no post-baseline gate, mixed histories): exit code 2."""


def candidates(n_layers: int) -> list[int]:
    """The mid band: every routed layer but the first and the last (all of them below three layers).

    >>> candidates(8), candidates(2)
    ([1, 2, 3, 4, 5, 6], [0, 1])
    """
    return list(range(1, n_layers - 1)) if n_layers >= 3 else list(range(n_layers))


def set_size(n_layers: int) -> int:
    """How many layers ``auto`` protects: as many as ``mid``, at most the number of candidates.

    >>> set_size(8), set_size(27), set_size(3)
    (4, 14, 1)
    """
    return min(len(protected_ordinals(n_layers, "mid")), len(candidates(n_layers)))


def _median(values: Sequence[Any]) -> float | None:
    finite = [v for v in (finite_number(x) for x in values) if v is not None]
    return float(np.median(finite)) if finite else None


def _key(row: dict[str, Any]) -> tuple:
    """Sort key, best first: persistent, larger C2 loss, larger persistence, smaller ordinal."""
    loss = row["c2_loss"] if row["c2_loss"] is not None else -math.inf
    persistence = row["persistence"] if row["persistence"] is not None else -math.inf
    return (not row["persistent"], -loss, -persistence, row["ordinal"])


def _beats(challenger: dict[str, Any], member: dict[str, Any], margin: float) -> bool:
    """Does a layer outside the set displace a member (by more than the margin, or by persistence)?"""
    if challenger["persistent"] != member["persistent"]:
        return challenger["persistent"]
    if challenger["c2_loss"] is None:
        return False
    if member["c2_loss"] is None:
        return True
    return challenger["c2_loss"] > member["c2_loss"] + margin


def _fmt(x: float | None, spec: str = "+.4f") -> str:
    return "-" if x is None else format(x, spec)


def choose(
    evidence: Sequence[dict[str, Any]],
    *,
    previous: Sequence[int] | None = None,
    margin: float = 0.005,
    persistence_floor: float = 0.5,
    size: int | None = None,
) -> dict[str, Any]:
    """The protected set from per-layer evidence (pure; the rule is in the module docstring).

    ``evidence``: one entry per routed layer with ``ordinal``, ``c2_deltas`` (per post-baseline gate) and
    ``alive`` (fraction of experts alive per gate), optionally ``name``; in any order. ``previous``: the set
    in force (the last gate's), kept unless outranked by more than ``margin``. Returns ``ordinals`` (sorted),
    ``layers`` (per layer, by ordinal: ``c2_loss``, ``persistence``, ``persistent``, ``candidate``, ``rank``
    among the candidates, ``chosen``, ``reason``) and ``changes`` (the swaps made against ``previous``).
    """
    rows = []
    n = len(evidence)
    band = set(candidates(n))
    for ev in sorted(evidence, key=lambda e: int(e["ordinal"])):
        o = int(ev["ordinal"])
        deltas = [finite_number(d) for d in ev["c2_deltas"]]
        loss = _median([-d for d in deltas if d is not None])
        persistence = _median(ev["alive"])
        rows.append({"ordinal": o, "name": ev.get("name", f"layer {o}"), "c2_loss": loss, "persistence": persistence,
                     "persistent": persistence is not None and persistence >= persistence_floor,
                     "candidate": o in band, "gates": sum(d is not None for d in deltas), "rank": None})
    if sorted(r["ordinal"] for r in rows) != list(range(n)):
        raise ProtectionError(f"the evidence must hold routed-layer ordinals 0..{n - 1} once each")
    ranked = sorted((r for r in rows if r["candidate"]), key=_key)
    for i, r in enumerate(ranked, 1):
        r["rank"] = i
    k = set_size(n) if size is None else min(size, len(ranked))
    fresh = [r["ordinal"] for r in ranked[:k]]
    by_ord = {r["ordinal"]: r for r in rows}
    changes: list[dict[str, Any]] = []
    prev = sorted(set(int(o) for o in previous)) if previous is not None else None
    if prev is None or len(prev) != k or not set(prev) <= band:
        chosen = set(fresh)
    else:
        chosen = set(prev)
        while True:
            outside = sorted((by_ord[o] for o in band - chosen), key=_key)
            weakest = max((by_ord[o] for o in chosen), key=_key)
            if not outside or not _beats(outside[0], weakest, margin):
                break
            best = outside[0]
            chosen = (chosen - {weakest["ordinal"]}) | {best["ordinal"]}
            changes.append({"added": best["ordinal"], "removed": weakest["ordinal"], "reason": (
                f"{best['name']} (C2 loss {_fmt(best['c2_loss'])}, persistence {_fmt(best['persistence'], '.2f')}) "
                f"outranks {weakest['name']} (C2 loss {_fmt(weakest['c2_loss'])}, persistence "
                f"{_fmt(weakest['persistence'], '.2f')}) by more than the margin {margin:g}"
                + ("" if best["persistent"] == weakest["persistent"] else " or by persistence"))})
    for r in rows:
        r["chosen"] = r["ordinal"] in chosen
        r["reason"] = _reason(r, len(ranked), persistence_floor)
    return {"ordinals": sorted(chosen), "layers": rows, "changes": changes, "size": k,
            "kept_previous": prev is not None and sorted(chosen) == prev}


def _reason(row: dict[str, Any], n_candidates: int, floor: float) -> str:
    if not row["candidate"]:
        return "endpoint layer: not in the mid band"
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
    """The gates that carry per-layer C2 deltas against a baseline (every gate but baselines)."""
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


def _previous(records: Sequence[dict[str, Any]]) -> list[int] | None:
    """The set in force: the last record's, when it was chosen by ``auto``."""
    if records and str(records[-1].get("protected_source", "")) == AUTO:
        return list(records[-1].get("protected_layers") or [])
    return None


def resolve(records: Sequence[dict[str, Any]], n_layers: int, lifecycle: LifecycleConfig) -> dict[str, Any]:
    """The set ``auto`` gives after ``records`` (a run's history, oldest first), with the record's fields.

    Returns ``ordinals``, ``source`` (``"auto"`` or the ``mid`` fallback and why), ``evidence_steps``,
    ``layers`` (per-layer numbers and reasons, empty on the fallback), ``changes`` (the swaps, each with
    its reason) and ``change`` (the set before and after when it differs from the last record's, else None).
    """
    ev, steps = evidence(records)
    last = list(records[-1].get("protected_layers") or []) if records and "protected_layers" in records[-1] else None
    if len(steps) < lifecycle.auto_min_gates or len(ev) != n_layers:
        why = (f"{len(steps)} of {lifecycle.auto_min_gates} post-baseline gates" if len(ev) in (0, n_layers)
               else f"the record has {len(ev)} routed layers, the model {n_layers}")
        out = {"ordinals": protected_ordinals(n_layers, "mid"), "source": f"mid (no evidence yet: {why})",
               "evidence_steps": steps, "layers": [], "changes": []}
    else:
        chosen = choose(ev, previous=_previous(records), margin=lifecycle.auto_margin,
                        persistence_floor=lifecycle.auto_persistence_floor)
        out = {"ordinals": chosen["ordinals"], "source": AUTO, "evidence_steps": steps,
               "layers": chosen["layers"], "changes": chosen["changes"]}
    out["change"] = None
    if last is not None and sorted(last) != out["ordinals"]:
        reason = "; ".join(c["reason"] for c in out["changes"]) or (
            f"{out['source']}, after {records[-1].get('protected_source')}")
        out["change"] = {"from": sorted(last), "to": out["ordinals"], "reason": reason}
    return out


def record_fields(resolved: dict[str, Any]) -> dict[str, Any]:
    """What a gate record carries of the choice: the set, its source, the per-layer reasons, a change."""
    out: dict[str, Any] = {"protected_layers": resolved["ordinals"], "protected_source": resolved["source"],
                           "protected_evidence_steps": resolved["evidence_steps"]}
    if resolved["layers"]:
        out["protection"] = [{k: r[k] for k in ("ordinal", "c2_loss", "persistence", "rank", "chosen", "reason")}
                             for r in resolved["layers"]]
    if resolved["change"] is not None:
        out["protected_change"] = resolved["change"]
    return out


def for_gate(run_path: Path | None, canary_fingerprint: str, layer_names: list[str],
             lifecycle: LifecycleConfig) -> dict[str, Any]:
    """The choice for the next gate of a run (evidence: its history's gates on this canary and layout).

    A record that cannot be read never stops a gate: the set falls back to ``mid`` and the source says why.
    """
    n = len(layer_names)
    try:
        records = read_history(run_path) if run_path is not None and _has_gates(run_path) else []
        records = [r for r in records if r.get("canary_fingerprint") == canary_fingerprint
                   and [lay.get("name") for lay in r.get("layers", [])] == layer_names]
        return resolve(records, n, lifecycle)
    except (HistoryError, ProtectionError, OSError, KeyError, TypeError, ValueError) as exc:
        return {"ordinals": protected_ordinals(n, "mid"), "source": f"mid (evidence unreadable: {exc})",
                "evidence_steps": [], "layers": [], "changes": [], "change": None}


def _has_gates(path: Path) -> bool:
    try:
        gates_file(path)
    except FileNotFoundError:
        return False
    return True


def protect(path: str | Path, config: AtlasConfig | None = None) -> dict[str, Any]:
    """The set ``auto`` chooses from a run's record (its atlas directory or ``gates.jsonl``).

    Raises :class:`ProtectionError` when the record is missing or unreadable, mixes histories, or has
    fewer post-baseline gates than ``lifecycle.auto_min_gates``.
    """
    cfg = config or AtlasConfig()
    try:
        records, file = read_run_gates(path)
    except (HistoryError, OSError) as exc:
        raise ProtectionError(str(exc)) from None
    ev, steps = evidence(records)
    if len(steps) < cfg.lifecycle.auto_min_gates:
        raise ProtectionError(f"{file} has {len(steps)} post-baseline gate(s) with per-layer C2 deltas; "
                              f"choosing needs {cfg.lifecycle.auto_min_gates} (lifecycle.auto_min_gates)")
    out = resolve(records, len(ev), cfg.lifecycle)
    out.update(gates_file=str(file), n_layers=len(ev), size=set_size(len(ev)),
               margin=cfg.lifecycle.auto_margin, persistence_floor=cfg.lifecycle.auto_persistence_floor)
    return out


# --- command line -------------------------------------------------------------------------------------


def table(result: dict[str, Any]) -> str:
    """The chosen layers first, then the other candidates and the endpoints, each with its numbers."""
    lines = [f"protected layers (auto): {result['ordinals']} of {result['n_layers']} routed layers, from the "
             f"post-baseline gates at steps {result['evidence_steps']}",
             f"  rule: mid band (all but the first and last routed layer), persistent first (experts alive >= "
             f"{result['persistence_floor']:g}), then worst median C2 loss; {result['size']} layers; "
             f"hysteresis margin {result['margin']:g}"]
    if result["change"] is not None:
        lines.append(f"  changed from {result['change']['from']}: {result['change']['reason']}")
    lines.append(f"  {'':2} {'ord':>3}  {'layer':<28} {'C2 loss':>9} {'persist':>8} {'rank':>5}  reason")
    order = sorted(result["layers"], key=lambda r: (not r["chosen"], r["rank"] is None, r["rank"] or 0, r["ordinal"]))
    for r in order:
        lines.append(f"  {'*' if r['chosen'] else ' ':2} {r['ordinal']:>3}  {str(r['name'])[:28]:<28} "
                     f"{_fmt(r['c2_loss']):>9} {_fmt(r['persistence'], '.2f'):>8} {r['rank'] or '-'!s:>5}  "
                     f"{r['reason']}")
    return "\n".join(lines)




