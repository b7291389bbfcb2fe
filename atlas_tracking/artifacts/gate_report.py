"""GateReport: the receipts of one gate, its JSON artifact, and the verifier that recomputes it.

The artifact holds a ``schema_version``, the canary and model fingerprints, a ``layers`` list
(one entry per routed layer with its receipts under the names docs/receipts.md uses), a
``summary``, and the per-window arrays from which ``verify`` re-derives every value.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from atlas_tracking.artifacts.derivation import derive, derive_drift
from atlas_tracking.artifacts.io import check_header, jsonable, write_atomic
from atlas_tracking.artifacts.receipts_file import FormError, decode, encode, form_of
from atlas_tracking.artifacts.retention import pruned_note
from atlas_tracking.receipts.windows import RANGES
from atlas_tracking.schema.artifacts import (
    BASE_DAMAGE_KEYS,
    DRIFT_KIND,
    EXACT_ONLY,
    RECEIPTS_KIND,
    RECEIPTS_SCHEMA_VERSION,
)
from atlas_tracking.schema.record import COMOVE_FIELDS, DELTA_FIELDS, Margins, fields


class ArtifactError(ValueError):
    """A receipts artifact is unreadable, truncated, or of an unknown schema."""


def model_fingerprint(model_class: str, layers: list[dict[str, Any]]) -> str:
    """sha256 of the model class and each routed layer's (name, family, E, k, d)."""
    keys = [(lay["name"], lay["family"], lay["num_experts"], lay["top_k"], lay["hidden_size"]) for lay in layers]
    return hashlib.sha256(json.dumps([model_class, keys]).encode()).hexdigest()


@dataclass
class GateReport:
    """Receipts of one gate: per-layer values and CIs, a cross-layer summary, and per-window arrays."""

    step: int | None
    canary: dict[str, Any]
    model: dict[str, Any]
    config: dict[str, Any]
    layers: list[dict[str, Any]]
    summary: dict[str, Any]
    per_window: dict[str, Any]
    drift: dict[str, Any] | None = None
    anchors: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    """The anchors collected during the gate (not serialised; see ``Baseline.from_report``): ``tensors``, a
    ``TensorSpool`` under the baseline's tensor names, read from its temporary file as they are needed; the
    ``positions``, ``batch_windows`` and ``storage`` form; and ``kl`` (the vocabulary size, or why the base
    log-probabilities are absent)."""

    # --- views --------------------------------------------------------------------------------
    def layer(self, name: str) -> dict[str, Any]:
        for layer in self.layers:
            if layer["name"] == name:
                return layer
        raise KeyError(f"no routed layer named {name!r} in this report")

    # --- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return jsonable(
            {
                "schema_version": RECEIPTS_SCHEMA_VERSION,
                "kind": RECEIPTS_KIND,
                "step": self.step,
                "canary": self.canary,
                "model": self.model,
                "config": self.config,
                "summary": self.summary,
                "layers": self.layers,
                "drift": self.drift,
                "per_window": self.per_window,
            }
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False)

    def save(self, path: str | Path) -> Path:
        """Write the artifact atomically (a temporary file, then a rename): safetensors when ``path`` ends in
        ``.safetensors``, else JSON (:mod:`~atlas_tracking.artifacts.receipts_file`)."""
        data = self.to_json() if form_of(path) == "json" else encode(self.to_dict(), "safetensors", 0)[1]
        return write_atomic(Path(path), data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GateReport:
        check_artifact(data)
        return cls(
            step=data.get("step"),
            canary=data["canary"],
            model=data["model"],
            config=data["config"],
            layers=data["layers"],
            summary=data["summary"],
            per_window=data["per_window"],
            drift=data.get("drift"),
        )

    @classmethod
    def load(cls, path: str | Path) -> GateReport:
        return cls.from_dict(read_artifact(path))


def read_artifact(path: str | Path) -> dict[str, Any]:
    """The document of a receipts artifact in either form (``.json`` or ``.safetensors``), checked: every reader
    of receipts artifacts reads them here."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        note = pruned_note(path)  # removed by gate.keep_receipts: the record says so (docs/record.md#retention)
        raise ArtifactError(f"cannot read receipts artifact {path}: {note or exc.strerror}") from None
    try:
        data = decode(raw, path.name)
    except FormError as exc:
        raise ArtifactError(f"receipts artifact {path} is {exc}") from None
    check_artifact(data, str(path))
    return data


def check_artifact(data: Any, where: str = "receipts artifact") -> None:
    """A receipts artifact's header and sections; a ``compare`` artifact is named as one.

    >>> check_artifact({"kind": "atlas-drift"}, "drift.json")
    Traceback (most recent call last):
    ...
    atlas_tracking.artifacts.gate_report.ArtifactError: drift.json is a compare artifact (kind 'atlas-drift', written by `atlas-tracking compare`, which prints its drift table; fields: docs/cli.md#compare), not receipts: `report` and `verify` read a receipts artifact (`atlas-tracking measure --out`) or a run directory
    """
    if isinstance(data, dict) and data.get("kind") == DRIFT_KIND:
        raise ArtifactError(f"{where} is a compare artifact (kind {DRIFT_KIND!r}, written by `atlas-tracking compare`, "
                            "which prints its drift table; fields: docs/cli.md#compare), not receipts: `report` and "
                            "`verify` read a receipts artifact (`atlas-tracking measure --out`) or a run directory")
    check_header(data, RECEIPTS_KIND, RECEIPTS_SCHEMA_VERSION, where, ArtifactError)
    for key in ("canary", "model", "config", "layers", "summary", "per_window"):
        if key not in data:
            raise ArtifactError(f"{where} lacks the {key!r} section (truncated or corrupted?)")


# --- derivation shared by measure and verify ------------------------------------------------------


def _close(a: Any, b: Any) -> bool:
    """A stored value against its recomputation: numbers to float rounding, lists and dicts (the near-tie shares per
    precision) element by element.

    >>> _close({"bf16": 0.1, "fp16": [0.0, 0.2]}, {"bf16": 0.1 + 1e-17, "fp16": [0.0, 0.2]}), _close({"bf16": 0.1}, {})
    (True, False)
    """
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return a == b


def verify(data: dict[str, Any]) -> list[str]:
    """Recompute every derived value, CI, pass/fail and summary from the per-window arrays.

    Returns a list of disagreements (empty when the artifact is self-consistent).
    """
    check_artifact(data)
    meta = [{k: v for k, v in lay.items() if k not in ("receipts", "ci")} for lay in data["layers"]]
    exact = [{k: lay["receipts"].get(k) for k in EXACT_ONLY if k in lay["receipts"]} for lay in data["layers"]]
    canary = data["canary"]
    try:
        layers, summ = derive(
            meta, data["per_window"], canary["n_windows"], canary["window"], data["config"]["receipts"], exact
        )
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        return [f"per-window arrays are incomplete or malformed: {type(exc).__name__}: {exc}"]
    problems: list[str] = []
    if data.get("drift") is not None:
        problems += _verify_drift(data, layers)
    for stored, fresh in zip(data["layers"], jsonable(layers)):
        for key, value in fresh["receipts"].items():
            if not _close(stored["receipts"].get(key), value):
                problems.append(f"{stored['name']}: {key} is {stored['receipts'].get(key)!r}, recomputed {value!r}")
        for key, value in fresh["ci"].items():
            if not _close(stored["ci"].get(key), value):
                problems.append(f"{stored['name']}: CI of {key} is {stored['ci'].get(key)!r}, recomputed {value!r}")
    for key, value in summ.items():
        if not _close(data["summary"].get(key), value):
            problems.append(f"summary: {key} is {data['summary'].get(key)!r}, recomputed {value!r}")
    if len(data["layers"]) != len(layers):
        problems.append(f"{len(data['layers'])} layers stored, {len(layers)} recomputed")
    return problems + _out_of_range(data)


RANGE_SLACK = 1e-5
"""Relative slack of a range check (float32 sums of per-token values that each lie in the range)."""


def _out_of_range(data: dict[str, Any]) -> list[str]:
    """Range-bounded receipts (``RANGES``) outside their range: each window's sum against its count, and
    each layer's stored value (docs/receipts.md#precision)."""
    problems = []
    for stored, pw in zip(data["layers"], data["per_window"]["layers"]):
        for key, (lo, hi) in RANGES.items():
            value = stored["receipts"].get(key)
            if value is not None and not lo - RANGE_SLACK <= value <= hi + RANGE_SLACK:
                problems.append(f"{stored['name']}: {key} is {value!r}, outside [{lo:g}, {hi:g}]")
            if key not in pw:
                continue
            sums, counts = (np.asarray(pw[key][part], dtype=np.float64) for part in ("sum", "count"))
            slack = RANGE_SLACK * np.maximum(counts, 1.0)
            bad = np.flatnonzero((sums < lo * counts - slack) | (sums > hi * counts + slack))
            if bad.size:
                w = int(bad[0])
                problems.append(f"{stored['name']}: window {w} {key} mean {sums[w] / max(counts[w], 1):.6g} is "
                                f"outside [{lo:g}, {hi:g}] ({bad.size} windows)")
    return problems


def _verify_drift(data: dict[str, Any], layers: list[dict[str, Any]]) -> list[str]:
    stored = data["drift"]
    canary = data["canary"]
    try:
        fresh = derive_drift(
            layers, data["per_window"], data["per_window"]["baseline"], stored["reference"],
            stored["handoff_reference"], canary["n_windows"] * canary["window"],
            data["config"]["receipts"], data["config"]["lifecycle"], stored.get("base"),
        )
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        return [f"drift per-window arrays are incomplete or malformed: {type(exc).__name__}: {exc}"]
    problems = []
    for key in (*fields(Margins), *DELTA_FIELDS, *BASE_DAMAGE_KEYS, *COMOVE_FIELDS):
        if key in (*BASE_DAMAGE_KEYS, *COMOVE_FIELDS, "refine_reference", "refine_margin_ci") and key not in stored:
            continue  # an artifact written before base-domain damage, the post-training base and co-movement
        if not _close(stored.get(key), fresh[key]):
            problems.append(f"drift: {key} is {stored.get(key)!r}, recomputed {fresh[key]!r}")
    for a, b in zip(stored["layers"], fresh["layers"]):
        for key, value in b.items():
            if key == "ci":
                for ck, cv in value.items():
                    if not _close(a["ci"].get(ck), cv):
                        problems.append(f"drift {a['name']}: CI of {ck} is {a['ci'].get(ck)!r}, recomputed {cv!r}")
            elif not _close(a.get(key), value):
                problems.append(f"drift {a['name']}: {key} is {a.get(key)!r}, recomputed {value!r}")
    return problems



