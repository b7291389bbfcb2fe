"""A declared healthy reference for the handoff margin (docs/policy.md#handoff-readiness).

Handoff readiness asks whether the atlas is inside the handoff boundary of a *healthy* atlas: the handoff
margin ``min over protected layers of lam1 (c2 - c2_ref) + lam2 (rho - 1)`` read against a reference the
operator declares (``lifecycle.handoff_reference``), not against the previous gate. The reference is the
per-layer receipts (``c2``, ``pi_min``, ...) of a healthy checkpoint measured on the same routed layers and
the same canary: a receipts artifact (``receipts/step_N.json`` of an earlier model of the family, or of
another run), a baseline directory, or ``gate:N``, this run's own gate at step N, read once that gate has
run.

Example:
    >>> import json, tempfile
    >>> from pathlib import Path
    >>> d = Path(tempfile.mkdtemp())
    >>> layers = [{"name": "model.layers.0.mlp", "family": "qwen3_moe", "num_experts": 8, "top_k": 2,
    ...            "hidden_size": 32}]
    >>> manifest = {"schema_version": 1, "kind": "atlas-baseline", "step": 400, "canary": {"fingerprint": "ab" * 32},
    ...             "model": {"class": "Qwen3MoeForCausalLM", "layers": layers},
    ...             "reference": [{"c2": 0.08, "pi_min": 0.02}]}
    >>> _ = (d / "manifest.json").write_text(json.dumps(manifest))
    >>> ref = HandoffReference.load(d)
    >>> ref.step, ref.layers
    (400, [{'c2': 0.08, 'pi_min': 0.02}])
    >>> ref.check_compatible(layers, "Qwen3MoeForCausalLM", "cd" * 32)
    Traceback (most recent call last):
    ...
    atlas_tracking.artifacts.handoff_reference.HandoffReferenceError: handoff reference ...: canary fingerprint mismatch: reference was measured on abababababab, this canary is cdcdcdcdcdcd; receipts are only compared on the same canary
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atlas_tracking.artifacts.baseline import Baseline, BaselineError, layer_key, reference_from_report
from atlas_tracking.artifacts.gate_report import ArtifactError, read_artifact
from atlas_tracking.artifacts.io import check_header
from atlas_tracking.schema.artifacts import BASELINE_KIND, BASELINE_MANIFEST_FILE, BASELINE_SCHEMA_VERSION


class HandoffReferenceError(ValueError):
    """A declared handoff reference cannot be read, or was measured on other routed layers or another canary."""


PINNED = "gate:"
"""``handoff_reference: gate:N`` pins this run's own gate at step N as the healthy reference."""


def pinned_step(spec: str | None) -> int | None:
    """The step of a pinned gate of this run (``gate:N``), or None for a path.

    >>> pinned_step("gate:450"), pinned_step("runs/healthy/atlas/receipts/step_00000450.json")
    (450, None)
    >>> pinned_step("gate:x")
    Traceback (most recent call last):
    ...
    atlas_tracking.artifacts.handoff_reference.HandoffReferenceError: handoff reference 'gate:x': a pinned gate is gate:STEP with STEP a whole number
    """
    if spec is None or not spec.startswith(PINNED):
        return None
    try:
        return int(spec[len(PINNED):])
    except ValueError:
        raise HandoffReferenceError(f"handoff reference {spec!r}: a pinned gate is gate:STEP with STEP a whole "
                                    "number") from None


@dataclass
class HandoffReference:
    """Per-layer reference receipts of a declared healthy checkpoint, with where they came from."""

    source: str
    """The path the reference was read from (recorded with every gate as ``handoff_reference``)."""
    step: int | None
    layers: list[dict[str, Any]]
    """Per routed layer, the receipts the handoff margin reads (``c2``, ``pi_min``, ...)."""
    model: dict[str, Any]
    """``class`` and ``layers`` (name, family, experts, top-k, width) of the reference's model."""
    canary_fingerprint: str

    @classmethod
    def load(cls, path: str | Path) -> HandoffReference:
        """Read a receipts artifact (a file) or a baseline directory (its manifest; no tensors are needed)."""
        path = Path(path)
        if path.is_dir():
            mpath = path / BASELINE_MANIFEST_FILE
            try:
                manifest = json.loads(mpath.read_text())
            except OSError as exc:
                raise HandoffReferenceError(f"handoff reference {path} is a directory without a readable "
                                            f"{BASELINE_MANIFEST_FILE}: {exc.strerror}") from None
            except json.JSONDecodeError as exc:
                raise HandoffReferenceError(f"handoff reference {mpath} is corrupted or truncated: {exc}") from None
            try:
                check_header(manifest, BASELINE_KIND, BASELINE_SCHEMA_VERSION, f"handoff reference {path}",
                             HandoffReferenceError)
                return cls(str(path), manifest.get("step"), list(manifest["reference"]), dict(manifest["model"]),
                           manifest["canary"]["fingerprint"])
            except (KeyError, TypeError) as exc:
                raise HandoffReferenceError(f"handoff reference {path}: the manifest lacks {exc}") from None
        try:
            data = read_artifact(path)
        except ArtifactError as exc:
            raise HandoffReferenceError(f"handoff reference: {exc}") from None
        model = {"class": data["model"].get("class"), "layers": [layer_key(layer) for layer in data["layers"]]}
        return cls(str(path), data.get("step"), reference_from_report(data), model, data["canary"]["fingerprint"])

    def check_compatible(self, model_layers: list[dict[str, Any]], model_class: str, canary_fingerprint: str) -> None:
        """Raise :class:`HandoffReferenceError` naming the first difference in routed layers or canary."""
        stub = Baseline({"canary": {"fingerprint": self.canary_fingerprint}, "model": self.model}, {})
        try:
            stub.check_compatible(model_layers, model_class, canary_fingerprint, what="reference")
        except BaselineError as exc:
            raise HandoffReferenceError(f"handoff reference {self.source}: {exc}") from None
        top1 = [layer.get("top_k") == 1 for layer in self.model.get("layers", [])]
        missing = [i for i, layer in enumerate(self.layers)
                   if not (isinstance(layer.get("c2"), (int, float)) or (i < len(top1) and top1[i]))
                   or not isinstance(layer.get("pi_min"), (int, float))]
        if missing:
            raise HandoffReferenceError(f"handoff reference {self.source}: routed layer(s) {missing} carry no c2 or "
                                        "pi_min, which the handoff margin reads (a top-1 layer needs pi_min only)")
