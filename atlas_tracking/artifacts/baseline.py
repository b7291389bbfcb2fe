"""Baselines: the reference gate stored beside a checkpoint, and drift against it.

A baseline directory holds ``anchors.safetensors`` (per layer and anchor token: z0, g0, R0, p0,
the tangent-projected base fields u0 of R0, base boundary membership b0, Gamma0, and beta0 for a LayerNorm
with a bias) and
``manifest.json`` (schema version, canary and model fingerprints, config, step, anchor
positions and their storage form, reference receipts and the per-window arrays used for paired bootstraps,
and the sha256 of the tensor file). It is loaded without pickle, and checked before use: the file's sha256 is
streamed, and its tensors are then read layer by layer from the memory-mapped file, only the rows of the anchors
one routed layer's hook needs in one micro-batch at a time (:mod:`atlas_tracking.artifacts.tensor_file`), so a
gate's host memory does not grow with the routed layers. The storage form (exact
float32, half precision without g0, or projected u0) is chosen from ``receipts.baseline_budget_bytes``
(docs/receipts.md#compact-anchors); a baseline without ``anchors.storage`` is exact float32.

With ``receipts.kl_top_k`` = K > 0 it also keeps, per canary predicted token, the base model's
top-K log-probabilities (``kl.logp`` fp32 ``[W, T-1, K]``), their vocabulary indices
(``kl.index`` int32) and the log of the remaining mass (``kl.log_rest`` fp32 ``[W, T-1]``):
K x 8 + 4 bytes per predicted token, from which each gate's ``kl_base`` is computed
(:mod:`atlas_tracking.receipts.kl`). The manifest's ``kl`` names K and the vocabulary size, or
why the tensors are absent; a baseline saved before they existed loads, with ``kl_base``
reported absent.

Example:
    >>> import numpy as np, torch, tempfile
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> from atlas_tracking import AtlasConfig, Baseline, Canary, measure
    >>> _ = torch.manual_seed(0)
    >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ...     head_dim=8, num_experts=8, num_experts_per_tok=2))
    >>> canary = Canary.from_token_ids(np.arange(2000) % 64, window=32, n_windows=8, seed=0)
    >>> cfg = AtlasConfig.from_dict({"receipts": {"progress": False, "anchors": 64}})
    >>> base = Baseline.from_report(measure(model, canary, config=cfg))
    >>> path = base.save(tempfile.mkdtemp() + "/baseline")
    >>> again = measure(model, canary, baseline=Baseline.load(path), config=cfg)
    >>> [layer["boundary_drift"] for layer in again.drift["layers"]], again.drift["refine_margin"]
    ([0.0, 0.0], 0.25)
    >>> again.drift["kl_base"], again.drift["canary_nll_delta"]
    (0.0, 0.0)
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atlas_tracking.artifacts.gate_report import GateReport
from atlas_tracking.artifacts.io import check_header, jsonable, replace_durably, write_atomic
from atlas_tracking.artifacts.tensor_file import TensorFile, read_rows, safetensors_chunks, tensor_meta
from atlas_tracking.receipts.sketch import sketch_matrix
from atlas_tracking.schema.artifacts import (
    BASE_TENSORS,
    BASELINE_KIND,
    BASELINE_MANIFEST_FILE,
    BASELINE_SCHEMA_VERSION,
    BASELINE_TENSORS_FILE,
    KL_TENSORS,
    NORM_TENSORS,
    REFERENCE_KEYS,
)

OLD_BASELINE_KL = ("this baseline was saved without the base model's top-K log-probabilities (before kl_base "
                   "existed); save a new baseline to measure kl_base")


class BaselineError(ValueError):
    """A baseline is missing, corrupted, of a newer schema, or does not match the model or canary."""


@dataclass(frozen=True)
class LayerReference:
    """One routed layer of a baseline as drift reads it: the rows of its anchors on demand, and, on the model's
    device, what a compact form needs beside them (the norm's ``gamma0`` and ``beta0`` to recompute ``g0``, the
    projection ``sketch`` of the fields)."""

    tensors: Mapping[str, torch.Tensor]
    layer: int
    gamma0: torch.Tensor | None = None
    beta0: torch.Tensor | None = None
    sketch: torch.Tensor | None = None

    def rows(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """Anchors ``start:end`` of each stored per-anchor tensor (``b0`` as bool), read now and on the host (a
        baseline loaded from disk holds none of them in between); the gate sends them to ``device``."""
        keys = [f"{self.layer}.{key}" for key in BASE_TENSORS if f"{self.layer}.{key}" in self.tensors]
        out = {key.split(".", 1)[1]: t for key, t in read_rows(self.tensors, keys, start, end).items()}
        out["b0"] = out["b0"].bool()
        return out


class Baseline:
    """A reference gate: manifest (plain JSON) plus per-layer anchor tensors, read on demand: from the gate's spool
    (``artifacts.tensor_spool``) when made from a report, from a :class:`TensorFile` once saved or loaded (or any
    mapping of tensors)."""

    def __init__(self, manifest: dict[str, Any], tensors: Mapping[str, torch.Tensor]):
        self.manifest = manifest
        self.tensors = tensors

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def from_report(cls, report: GateReport) -> Baseline:
        """Make a baseline from a gate measured without a baseline (or with ``keep_anchors=True``)."""
        if report.anchors is None:
            raise BaselineError("this report holds no anchor tensors: measure it with keep_anchors=True")
        tensors = report.anchors["tensors"]  # read from the gate's spool as they are needed, never all at once
        kl = report.anchors.get("kl") or {"absent": "this gate kept no base log-probabilities"}
        kl_info = ({"top_k": tensor_meta(tensors, "kl.logp")[1][-1], "vocab_size": kl["vocab_size"]}
                   if "kl.logp" in tensors else {"absent": kl["absent"]})
        pw = report.per_window
        layers_pw = [
            {"c2": lpw["c2"], "load": lpw["load"], "valid": lpw["margin_mean"]["count"]} for lpw in pw["layers"]
        ]
        manifest = jsonable(
            {
                "schema_version": BASELINE_SCHEMA_VERSION,
                "kind": BASELINE_KIND,
                "step": report.step,
                "canary": report.canary,
                "model": {**report.model, "layers": [layer_key(layer) for layer in report.layers]},
                "config": report.config,
                "anchors": {"positions": report.anchors["positions"], "batch_windows": report.anchors["batch_windows"],
                            **_storage(report.anchors, tensors)},
                "kl": kl_info,
                "reference": [{k: layer["receipts"].get(k) for k in REFERENCE_KEYS} for layer in report.layers],
                "summary": report.summary,
                "per_window": {"canary_nll": pw["canary_nll"], "layers": layers_pw},
            }
        )
        for ref in manifest["reference"]:
            ref["canary_nll"] = report.summary.get("canary_nll")
        return cls(manifest, tensors)

    # --- persistence ------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Write the directory atomically: a complete new copy replaces any previous one."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = directory.with_name(f".{directory.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        tmp.mkdir()  # the process umask applies (a temporary-directory helper would make it owner-only)
        try:
            # streamed one tensor at a time (never the whole file in memory), by Python: safetensors' own file
            # writer makes files owner-only
            write_atomic(tmp / BASELINE_TENSORS_FILE, safetensors_chunks(self.tensors, {"kind": BASELINE_KIND}))
            written, digest = TensorFile.hashed(tmp / BASELINE_TENSORS_FILE, BaselineError)
            manifest = {**self.manifest, "tensors_sha256": digest}
            write_atomic(tmp / BASELINE_MANIFEST_FILE, json.dumps(manifest, indent=1, allow_nan=False))
            if directory.exists():
                old = directory.with_name(f".{directory.name}.old")
                shutil.rmtree(old, ignore_errors=True)
                replace_durably(directory, old)
                replace_durably(tmp, directory)
                shutil.rmtree(old, ignore_errors=True)
            else:
                replace_durably(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.manifest = manifest
        # from now on read from the file just written (the same inode in its new directory): no host copy is kept
        self.tensors = TensorFile(directory / BASELINE_TENSORS_FILE, written.identity, BaselineError)
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> Baseline:
        """Read and check a baseline directory (JSON + safetensors, never pickle)."""
        directory = Path(directory)
        mpath, tpath = directory / BASELINE_MANIFEST_FILE, directory / BASELINE_TENSORS_FILE
        if not mpath.exists() or not tpath.exists():
            raise BaselineError(f"{directory} is not a baseline directory (needs {BASELINE_MANIFEST_FILE} and {BASELINE_TENSORS_FILE})")
        try:
            manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError as exc:
            raise BaselineError(f"baseline manifest {mpath} is corrupted or truncated: {exc}") from None
        check_header(manifest, BASELINE_KIND, BASELINE_SCHEMA_VERSION, f"baseline {directory}", BaselineError)
        from safetensors import SafetensorError

        try:
            tensors, digest = TensorFile.hashed(tpath, BaselineError)
            if digest != manifest.get("tensors_sha256"):
                raise BaselineError(f"baseline tensors {tpath} do not match the manifest checksum (corrupted or replaced)")
            base = cls(manifest, tensors)
            base._check_shapes(tensors)
        except (SafetensorError, OSError) as exc:
            raise BaselineError(f"cannot read baseline tensors {tpath}: {exc}") from None
        return base

    def _check_shapes(self, tensors: TensorFile) -> None:
        """Every tensor the manifest needs, of the shape it needs, from the file's header (no tensor is read)."""
        n_anchor = len(self.manifest["anchors"]["positions"])
        for i, layer in enumerate(self.manifest["model"]["layers"]):
            for key in (*BASE_TENSORS, "gamma0"):
                if key == "g0" and self.storage is not None and self.storage["form"] != "exact":
                    continue  # recomputed from z0 and gamma0
                if f"{i}.{key}" not in tensors:
                    raise BaselineError(f"baseline lacks tensor {i}.{key} for layer {layer['name']}")
            if tensors.shape(f"{i}.z0") != (n_anchor, layer["hidden_size"]):
                raise BaselineError(f"baseline tensor {i}.z0 has shape {tensors.shape(f'{i}.z0')}")
        if self.kl_absent is None:
            canary, k = self.manifest["canary"], self.manifest["kl"]["top_k"]
            rows = (canary["n_windows"], canary["window"] - 1)
            for key, shape in (("logp", (*rows, k)), ("index", (*rows, k)), ("log_rest", rows)):
                got = tensors.shape(f"kl.{key}") if f"kl.{key}" in tensors else None
                if got != shape:
                    shown = "missing" if got is None else f"shape {got}"
                    raise BaselineError(f"baseline tensor kl.{key} is {shown}; the manifest needs shape {shape}")

    # --- use --------------------------------------------------------------------------------
    @property
    def positions(self) -> np.ndarray:
        return np.asarray(self.manifest["anchors"]["positions"], dtype=np.int64)

    def check_compatible(self, model_layers: list[dict[str, Any]], model_class: str, canary_fingerprint: str,
                         what: str = "baseline") -> None:
        """Raise :class:`BaselineError` naming the first mismatch with this model and canary.

        What must match is the routed layers (family, experts, top-k, width, and the layer path up
        to a wrapper's prefix), not the class that wraps them: a baseline saved while training a
        ``LightningModule`` (layers ``model.model.layers.N.mlp``) serves the exported transformers
        checkpoint (``model.layers.N.mlp``). ``model_class`` only names the model in messages, ``what`` the
        artifact (a handoff reference checks its layers here too).
        """
        base_fp = self.manifest["canary"]["fingerprint"]
        if base_fp != canary_fingerprint:
            raise BaselineError(
                f"canary fingerprint mismatch: {what} was measured on {base_fp[:12]}, this canary is "
                f"{canary_fingerprint[:12]}; receipts are only compared on the same canary"
            )
        mine = [layer_key(layer) for layer in model_layers]
        theirs = self.manifest["model"]["layers"]
        if len(mine) != len(theirs):
            raise BaselineError(
                f"architecture mismatch: {what} ({self.manifest['model']['class']}) has {len(theirs)} routed "
                f"layers, model ({model_class}) has {len(mine)}")
        for a, b in zip(mine, theirs):
            diff = [f"{k} {b.get(k)} vs {a[k]}" for k in a if k != "name" and a[k] != b.get(k)]
            if not _same_path(a["name"], b["name"]):
                diff.insert(0, f"path {b['name']} vs {a['name']}")
            if diff:
                raise BaselineError(f"architecture mismatch at routed layer {a['name']}: {', '.join(diff)} "
                                    f"({what} vs model)")

    @property
    def kl_absent(self) -> str | None:
        """Why this baseline cannot give ``kl_base`` (None when it can)."""
        kl = self.manifest.get("kl")
        return OLD_BASELINE_KL if kl is None else kl.get("absent")

    def kl_base_slice(self, start: int, end: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The base top-K (``logp``, ``index``, ``log_rest``) of canary windows ``start:end``; a
        :class:`BaselineError` naming both sizes when the model's vocabulary is not the baseline's."""
        base_vocab = self.manifest["kl"]["vocab_size"]
        if vocab_size != base_vocab:
            raise BaselineError(f"vocabulary mismatch: the baseline's log-probabilities are over {base_vocab} tokens, "
                                f"this model's logits over {vocab_size}; kl_base compares the same vocabulary")
        rows = read_rows(self.tensors, [f"kl.{key}" for key in KL_TENSORS], start, end)
        return tuple(rows.values())  # type: ignore[return-value]

    @property
    def storage(self) -> dict[str, Any] | None:
        """The anchors' storage form (docs/receipts.md#compact-anchors); None: a baseline saved before storage forms
        existed, exact float32."""
        return self.manifest["anchors"].get("storage")

    def layer_reference(self, i: int, device: torch.device) -> LayerReference:
        """Layer ``i`` as drift reads it on ``device``: its anchors' rows are read when a micro-batch needs them
        (:meth:`LayerReference.rows`); a compact form adds the norm's ``gamma0`` (and ``beta0``), ``d`` values
        each, to recompute ``g0``, and the projection ``sketch`` of the fields."""
        norm: dict[str, torch.Tensor] = {}
        storage = self.storage
        if storage is not None and storage["form"] != "exact":
            norm = {key: self.tensors[f"{i}.{key}"].to(device) for key in NORM_TENSORS if f"{i}.{key}" in self.tensors}
        sketch = None
        if storage is not None and storage["sketch_dim"]:
            width = self.manifest["model"]["layers"][i]["hidden_size"]
            sketch = sketch_matrix(storage["sketch_dim"], width, storage["sketch_seed"]).to(device)
        return LayerReference(self.tensors, i, sketch=sketch, **norm)


def _storage(anchors: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The manifest's ``storage``: the form a gate chose, with the dtype each anchor tensor is stored in."""
    if "storage" not in anchors:
        return {}
    dtypes = {key: str(tensor_meta(tensors, f"0.{key}")[0]).removeprefix("torch.") if f"0.{key}" in tensors
              else "recomputed" for key in BASE_TENSORS}
    return {"storage": {**anchors["storage"], "dtypes": dtypes}}


def layer_key(layer: dict[str, Any]) -> dict[str, Any]:
    """What must match between a routed layer and its reference: path, family, experts, top-k and width."""
    return {k: layer[k] for k in ("name", "family", "num_experts", "top_k", "hidden_size")}


def _same_path(a: str, b: str) -> bool:
    """The same module path, up to a prefix added by a wrapper (``model.layers.0.mlp`` in ``model.model.layers.0.mlp``).

    >>> _same_path("model.model.layers.0.mlp", "model.layers.0.mlp"), _same_path("layers.10.mlp", "layers.0.mlp")
    (True, False)
    """
    return a == b or a.endswith("." + b) or b.endswith("." + a)


# --- drift receipts from per-window arrays (shared by measure and verify) --------------------------


def reference_from_report(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-layer reference receipts (c2, pi_min, ...) from a receipts JSON, for the handoff margin."""
    return [{k: layer["receipts"].get(k) for k in REFERENCE_KEYS if k in layer["receipts"]} for layer in data["layers"]]

