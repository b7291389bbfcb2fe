"""W&B delivery: metrics, per-layer tables and charts, a C2 heatmap, and ``run.alert`` for alerts.

The summary's ``atlas/verdict`` and ``atlas/verdict_source`` are the gate's one verdict and the part that raised it
(:func:`~atlas_tracking.schema.verdict.gate_verdict`); every alert's text opens with it.

``WandbSink`` works with a ``wandb`` run or a Lightning ``WandbLogger`` (then metrics go through
``logger.log_metrics`` so their x-axis is ``trainer/global_step``). wandb is imported lazily; a heatmap
that cannot be drawn is left out with a warning and the rest of the gate is still logged. An offline
run is read back without a server by :mod:`atlas_tracking.testing.wandb_offline`.
"""

from __future__ import annotations

import io
from datetime import timedelta
from typing import Any

from atlas_tracking.artifacts.expert_text import layer_label
from atlas_tracking.artifacts.load_summary import expert_layers
from atlas_tracking.receipts.experts import OVERLOAD_FACTOR, expert_shares, share_change
from atlas_tracking.schema.record import FAILED
from atlas_tracking.schema.verdict import Verdict, failed_event_verdict, gate_verdict
from atlas_tracking.sinks.figures import FigureGuard
from atlas_tracking.viz.figures import TRAIN_LOAD, c2_change_row, fig_c2_heatmap, fig_expert_load, png_bytes
from atlas_tracking.viz.tables import top1

TABLE_COLUMNS = ("layer", "ordinal", "protected", "c2", "dead_experts", "router_entropy", "load_cv", "margin_mean",
                 "ov_cf", "v2_c1", "v2_c2", "coord_drift", "boundary_drift", "content_drift", "c2_delta")
GATE_COLUMNS = ("step", "verdict", "verdict_source", "verdict_reason", "status", "stage", "action")
"""Columns of ``atlas/gate``: the gate's verdict, the part that raised it and why, the receipt-level status, the
stage and the action (docs/policy.md#the-verdict)."""
EXPERT_COLUMNS = ("layer", "layer_index", "ordinal", "expert", "load", "share", "share_delta", "dead", "overloaded")
"""Columns of ``atlas/experts``: one row per routed layer and expert (``share_delta``: since the baseline)."""
LOAD_COLUMNS = ("step", "layer", "name", "expert", "routes", "share", "dead")
"""Columns of ``atlas/train/experts``: one row per routed layer and expert of an interval's training batches."""
STEP_KEY = "trainer/global_step"


class WandbSink:
    """Deliver atlas gates and alerts to a W&B run.

    Args:
        run: a ``wandb`` run (from ``wandb.init``).
        logger: a Lightning ``WandbLogger`` (its ``experiment`` is the run).
        per_layer_table: log a per-layer table and bar charts of C2 and dead experts at every gate, and the
            per-expert table ``atlas/experts``.
        heatmap: log a layers x gates heatmap image of C2 built from the gates seen so far, and the gate's
            layers x experts load heatmap (``atlas/expert_load``).
        step_key: the x-axis metric the gates are logged against when writing to ``run`` (the
            transformers ``WandbCallback`` plots against ``train/global_step``; a ``WandbLogger``
            uses its own).
    """

    name = "wandb"

    def __init__(self, run: Any = None, logger: Any = None, per_layer_table: bool = True, heatmap: bool = True,
                 step_key: str = STEP_KEY):
        if run is None and logger is None:
            raise ValueError("WandbSink needs a wandb run (wandb.init(...)) or a Lightning WandbLogger")
        self._run, self.logger = run, logger
        self.per_layer_table, self.heatmap, self.step_key = per_layer_table, heatmap, step_key
        self._defined = False
        self._history: list[tuple[int, list[float | None]]] = []
        self._layer_names: list[str] = []
        self._figures = FigureGuard(self.name)
        self._verdict: Verdict | None = None
        """The verdict of the last gate logged (its alerts follow it and say it)."""

    @property
    def run(self) -> Any:
        return self._run if self._run is not None else self.logger.experiment

    @property
    def run_key(self) -> str:
        """The W&B run this sink writes to (the trackers' catch-up keys its ledger by it)."""
        return str(self.run.id)

    def _define(self) -> None:
        run = self.run
        run.define_metric(self.step_key)
        run.define_metric("atlas/*", step_metric=self.step_key)
        self._defined = True

    def log_gate(self, record: dict[str, Any], metrics: dict[str, float], step: int) -> None:
        import wandb

        if not self._defined:
            self._define()
        gate_step = int(record["step"])  # the record's step names titles, tables and heatmap columns
        payload: dict[str, Any] = dict(metrics)
        layers = record.get("layers", [])
        if self.per_layer_table and layers:
            rows = [[lay.get("name"), lay.get("ordinal"), lay.get("protected")] + [lay.get(k) for k in TABLE_COLUMNS[3:]]
                    for lay in layers]
            table = wandb.Table(columns=list(TABLE_COLUMNS), data=rows)
            payload["atlas/layers"] = table
            if not top1(record):  # top-1 routing: no C2 to chart
                payload["atlas/c2_by_layer"] = wandb.plot.bar(table, "layer", "c2",
                                                              title=f"C2 per layer (step {gate_step})")
            payload["atlas/dead_by_layer"] = wandb.plot.bar(table, "layer", "dead_experts",
                                                            title=f"Dead experts per layer (step {gate_step})")
        experts = expert_rows(layers)
        if self.per_layer_table and experts:
            payload["atlas/experts"] = wandb.Table(columns=list(EXPERT_COLUMNS), data=experts)
        if self.heatmap and experts:
            image = self._figures.draw("expert load", lambda: wandb.Image(
                _pil(png_bytes(fig_expert_load(layers, gate_step), dpi=90)), caption=f"expert load, step {gate_step}"))
            if image is not None:
                payload["atlas/expert_load"] = image
        verdict = gate_verdict(record)
        self._verdict = verdict
        status = wandb.Table(columns=list(GATE_COLUMNS), data=[[gate_step, verdict.level, verdict.source, verdict.reason,
                                                                 record.get("status"), record.get("stage"),
                                                                 record.get("action")]])
        payload["atlas/gate"] = status
        self._history.append((gate_step, c2_change_row(record)))
        self._layer_names = [lay.get("name") for lay in layers] or self._layer_names
        if self.heatmap and layers and not top1(record):
            image = self._figures.draw("C2 heatmap", lambda: wandb.Image(self._heatmap_png(), caption="C2: layers x gates"))
            if image is not None:
                payload["atlas/c2_heatmap"] = image
        if self.logger is not None:
            self.logger.log_metrics(payload, step=step)
        else:
            self.run.log({**payload, self.step_key: step})
        summary = self.run.summary
        summary["atlas/verdict"] = verdict.level
        summary["atlas/verdict_source"] = verdict.source
        summary["atlas/stage"] = record.get("stage")
        summary["atlas/last_gate_step"] = gate_step

    def log_load(self, line: dict[str, Any], metrics: dict[str, float], step: int, picture: bool) -> None:
        """One interval of training-batch load: its bounded scalars and, when ``picture``, the layers x experts
        table ``atlas/train/experts`` and picture ``atlas/train/expert_load``."""
        import wandb

        if not self._defined:
            self._define()
        payload: dict[str, Any] = dict(metrics)
        if picture:
            payload["atlas/train/experts"] = wandb.Table(columns=list(LOAD_COLUMNS), data=load_rows(line))
            layers = expert_layers(line)
            image = self._figures.draw(TRAIN_LOAD.lower(), lambda: wandb.Image(
                _pil(png_bytes(fig_expert_load(layers, int(line["step"]), TRAIN_LOAD), dpi=90)),
                caption=f"training-batch expert load, steps {line.get('first_step')}-{line['step']}"))
            if image is not None:
                payload["atlas/train/expert_load"] = image
        if self.logger is not None:
            self.logger.log_metrics(payload, step=step)
        else:
            self.run.log({**payload, self.step_key: step})

    def log_rollout(self, line: dict[str, Any], metrics: dict[str, float], step: int) -> None:
        """A recorded step's rollout-agreement scalars (``atlas/rollout/...``, docs/rollout.md#trackers)."""
        if not self._defined:
            self._define()
        if self.logger is not None:
            self.logger.log_metrics(dict(metrics), step=step)
        else:
            self.run.log({**metrics, self.step_key: step})

    def _heatmap_png(self):
        from PIL import Image

        return Image.open(io.BytesIO(png_bytes(fig_c2_heatmap(self._history, self._layer_names), dpi=90)))

    def alert(self, event: dict[str, Any]) -> None:
        import wandb

        failed_verdict = failed_event_verdict(event)
        verdict = failed_verdict or self._verdict
        text = event["text"] if verdict is None else f"Gate verdict {verdict.headline()}. {event['text']}"
        self.run.alert(
            title=event["title"][:63], text=text, level=getattr(wandb.AlertLevel, event["level"]),
            wait_duration=timedelta(seconds=float(event.get("wait_duration_s", 60.0))),
        )
        failed = event.get("failed")
        if failed is not None:  # a gate that could not run, or the first gate that ran after
            summary = self.run.summary
            summary["atlas/failed_count"] = 0 if "cleared_step" in failed else failed["count"]
            if "cleared_step" not in failed:
                summary["atlas/verdict"] = FAILED
                summary["atlas/verdict_source"] = failed_verdict.source if failed_verdict is not None else FAILED
                summary["atlas/failed_first_step"] = failed["first_step"]
                summary["atlas/failed_layers"] = ", ".join(failed["layers"])

    def finish(self) -> None:
        """Nothing to close: the run belongs to whoever created it."""
        return None


def _pil(png: bytes) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(png))


def load_rows(line: dict[str, Any]) -> list[list[Any]]:
    """Rows of ``atlas/train/experts`` (:data:`LOAD_COLUMNS`) from a ``load.jsonl`` line.

    >>> load_rows({"step": 50, "layers": [{"layer": 2, "name": "model.layers.2.mlp", "load": [3, 0, 1]}]})[0]
    [50, 2, 'model.layers.2.mlp', 0, 3, 0.75, False]
    """
    rows = []
    for row in line["layers"]:
        for e, (routes, share) in enumerate(zip(row["load"], expert_shares(row["load"]).tolist())):
            rows.append([int(line["step"]), row["layer"], row["name"], e, int(routes), share, routes == 0])
    return rows


def expert_rows(layers: list[dict[str, Any]]) -> list[list[Any]]:
    """Rows of ``atlas/experts`` (:data:`EXPERT_COLUMNS`) from a record's layers that carry ``expert_load``.

    >>> expert_rows([{"name": "model.layers.2.mlp", "index": 2, "ordinal": 0, "expert_load": [0, 3, 1],
    ...               "expert_load_baseline": [1, 1, 2]}])[1]
    ['layer 2', 2, 0, 1, 3, 0.75, 0.5, False, True]
    """
    rows = []
    for lay in layers:
        loads = lay.get("expert_load")
        if not loads:
            continue
        shares = expert_shares(loads)
        base = lay.get("expert_load_baseline")
        delta = share_change(loads, base).tolist() if base else [None] * len(loads)
        for e, (load, share, d) in enumerate(zip(loads, shares.tolist(), delta)):
            rows.append([layer_label(lay), lay.get("index"), lay.get("ordinal"), e, int(load), share, d, load == 0,
                         share > OVERLOAD_FACTOR / len(loads)])
    return rows
