"""MLflow delivery: ``log_batch`` metrics, verdict/stage tags, gate JSON, figures and the HTML report as artifacts,
and alerts as tags plus a table (``atlas/alerts.html``) and ``atlas/alerts.jsonl`` (MLflow has no run alerts of its own).

Tags stay short enough to read on the run page (at most :data:`TAG_CHARS` characters): ``atlas.verdict`` (the gate's
one verdict, :func:`~atlas_tracking.schema.verdict.gate_verdict`, plotted as ``atlas/verdict_code``),
``atlas.verdict.source`` (the part that raised it), ``atlas.stage``, the action's first clause; the long text is in
``atlas/report.html`` (the run's report, rewritten at every gate), ``atlas/gates/step_N.json`` and the alerts table.
The coded metrics' legends are params ``atlas.legend.<metric>`` (docs/trackers.md#mlflow).

``MlflowSink`` works with a Lightning ``MLFlowLogger`` (its ``experiment`` is an ``MlflowClient``)
or an explicit client and run id. Errors (a tracking server that is down) propagate, so that
:class:`atlas_tracking.sinks.delivery.Delivery` keeps the items and replays them when the server is back.
A figure that cannot be drawn is left out with a warning; metrics, tags and the gate JSON still go out.
mlflow is imported lazily. MLflow 3 refuses the plain file store: use ``sqlite:///...`` or a server.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from atlas_tracking.artifacts.load_summary import expert_layers
from atlas_tracking.schema.record import ALERT_LEVELS
from atlas_tracking.schema.verdict import LEVEL_CODES, code_legends, failed_event_verdict, gate_verdict
from atlas_tracking.sinks.figures import FigureGuard
from atlas_tracking.viz.alerts_table import alerts_page
from atlas_tracking.viz.figures import (
    TRAIN_LOAD,
    c2_change_row,
    fig_c2_heatmap,
    fig_expert_load,
    fig_layer_c2,
    pyplot,
)
from atlas_tracking.viz.html_report import run_page
from atlas_tracking.viz.tables import top1

_KEY_OK = re.compile(r"[^A-Za-z0-9_\-./ ]")
TAG_CHARS = 64
"""The longest tag value the sink writes: what the run page's tag chips show whole (an alert title fits: < 64)."""
REPORT = "atlas/report.html"
ALERTS_TABLE = "atlas/alerts.html"


def tag_text(text: str, limit: int = TAG_CHARS, clause: bool = True) -> str:
    """A tag value short enough to read: with ``clause``, the text's first clause (up to ``:``, ``;`` or the first
    sentence's end); cut at a word with an ellipsis when it is still longer than ``limit``.

    >>> tag_text("Intervene or stop claiming progress: repeated degradation with the same occupancy pathology.")
    'Intervene or stop claiming progress'
    >>> tag_text("RouterLogitsError: NaN in model.layers.1.mlp", clause=False)
    'RouterLogitsError: NaN in model.layers.1.mlp'
    >>> tag_text("a " * 40)[-3:], len(tag_text("a " * 40)) <= TAG_CHARS
    ('a …', True)
    """
    text = " ".join(str(text).split())
    first = re.split(r":\s|\.\s|\.$|;\s", text, maxsplit=1)[0] if clause else text
    if len(first) <= limit:
        return first
    return first[: limit - 1].rsplit(" ", 1)[0] + " …"


def mlflow_key(key: str) -> str:
    """A metric key MLflow accepts (letters, digits, ``_ - . / space``); others become ``_``.

    >>> mlflow_key("atlas/boundary_mass@0.01")
    'atlas/boundary_mass_0.01'
    """
    return _KEY_OK.sub("_", key)


class MlflowSink:
    """Deliver atlas gates and alerts to one MLflow run.

    Args:
        client: an ``mlflow.tracking.MlflowClient`` (with ``run_id``).
        run_id: the run to log into.
        logger: a Lightning ``MLFlowLogger`` (client and run id are taken from it).
        tracking_uri: build a client for this URI when no client or logger is given.
        figures: log the per-layer C2 bar chart, the C2 heatmap and the layers x experts load heatmap
            (``atlas/figures/expert_load_<record step>.png``) as artifacts at every gate.
        report: log the HTML report of the gates this run received (``atlas/report.html``) at every gate.
    """

    name = "mlflow"

    def __init__(self, client: Any = None, run_id: str | None = None, logger: Any = None,
                 tracking_uri: str | None = None, figures: bool = True, report: bool = True,
                 report_every_s: float = 60.0):
        if logger is None and run_id is None:
            raise ValueError("MlflowSink needs a Lightning MLFlowLogger or a run_id (with a client or tracking_uri)")
        if client is None and logger is None:
            if tracking_uri is None:
                raise ValueError("MlflowSink needs a client, a logger or a tracking_uri")
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=tracking_uri)
        self._client, self._run_id, self.logger = client, run_id, logger
        self.figures, self.report, self.report_every_s = figures, report, report_every_s
        self._report_at: float | None = None
        """When the HTML report was last uploaded (``time.monotonic``; None: never)."""
        self._report_stale = False
        """Whether gates arrived since the last upload."""
        self._records: list[dict[str, Any]] = []
        self._load: list[dict[str, Any]] = []
        self._rollout: list[dict[str, Any]] = []
        self._legend = False
        self._alerts: list[dict[str, Any]] = []
        self._highest: dict[str, Any] | None = None
        """The first alert of the highest level since the current baseline (``atlas.alert.max_*``)."""
        self._c2_history: list[tuple[int, list[float | None]]] = []
        self._layer_names: list[str] = []
        self._figures = FigureGuard(self.name)

    @property
    def client(self) -> Any:
        return self._client if self._client is not None else self.logger.experiment

    @property
    def run_id(self) -> str:
        return self._run_id if self._run_id is not None else self.logger.run_id

    @property
    def run_key(self) -> str:
        """The MLflow run this sink writes to (the trackers' catch-up keys its ledger by it)."""
        return self.run_id

    def log_gate(self, record: dict[str, Any], metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        gate_step = int(record["step"])  # the record's step names files, tags and figures; metrics sit at ``step``
        if record.get("status") == "BASELINE":
            self._highest = None
        batch = [Metric(mlflow_key(k), float(v), now, int(step)) for k, v in metrics.items()]
        verdict = gate_verdict(record)
        tags = [RunTag("atlas.verdict", verdict.level), RunTag("atlas.verdict.source", tag_text(verdict.source)),
                RunTag("atlas.stage", str(record.get("stage"))),
                RunTag("atlas.action", tag_text(str(record.get("action", "")))),
                RunTag("atlas.last_gate_step", str(gate_step))]
        params = [] if self._legend else [Param(f"atlas.legend.{key.removeprefix('atlas/')}", legend)
                                          for key, legend in code_legends().items()]
        self._legend = True
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000], tags=tags if i == 0 else [],
                                  params=params if i == 0 else [])
        if not batch:
            self.client.log_batch(self.run_id, tags=tags, params=params)
        self.client.log_text(self.run_id, json.dumps(record, indent=1, allow_nan=False),
                             f"atlas/gates/step_{int(record['step']):08d}.json")
        layers = record.get("layers", [])
        self._c2_history.append((gate_step, c2_change_row(record)))
        self._layer_names = [lay.get("name") for lay in layers] or self._layer_names
        if self.figures and layers and not top1(record):  # top-1 routing: no C2 to draw
            for figure, draw, name in (
                ("C2 per layer", lambda: fig_layer_c2(layers, f"C2 per layer, step {gate_step}"),
                 f"c2_by_layer_{gate_step:08d}.png"),
                ("C2 heatmap", lambda: fig_c2_heatmap(self._c2_history, self._layer_names), "c2_heatmap.png"),
            ):
                fig = self._figures.draw(figure, draw)
                if fig is not None:
                    self.client.log_figure(self.run_id, fig, f"atlas/figures/{name}")
                    pyplot().close(fig)
        if self.figures and any(lay.get("expert_load") for lay in layers):
            fig = self._figures.draw("expert load", lambda: fig_expert_load(layers, gate_step))
            if fig is not None:
                self.client.log_figure(self.run_id, fig, f"atlas/figures/expert_load_{gate_step:08d}.png")
                pyplot().close(fig)
        self._records.append(record)
        due = self._report_at is None or time.monotonic() - self._report_at >= self.report_every_s
        self._report_stale = True
        if due:
            self._upload_report()

    def _upload_report(self) -> None:
        """The HTML report of every gate received so far, as ``atlas/report.html`` (its cost grows with the run, so
        gates closer than ``report_every_s`` share one upload; :meth:`finish` writes the last)."""
        if not (self.report and self._records):
            return
        page = self._figures.draw("HTML report", lambda: run_page(
            self._records, f"atlas run: MLflow run {self.run_id}", load=self._load, rollout=self._rollout)[0])
        if page is not None:
            self.client.log_text(self.run_id, page, REPORT)
        self._report_at, self._report_stale = time.monotonic(), False

    def log_load(self, line: dict[str, Any], metrics: dict[str, float], step: int, picture: bool) -> None:
        """One interval of training-batch load: its bounded scalars at ``step`` and, when ``picture``, the
        layers x experts picture (``atlas/figures/train_expert_load_<step>.png``) and the interval's line
        (``atlas/load/step_<step>.json``: every layer's routes per expert, the table W&B gets)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), float(v), now, int(step)) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])
        self._load.append(line)
        if not picture:
            return
        at = int(line["step"])
        self.client.log_text(self.run_id, json.dumps(line, allow_nan=False), f"atlas/load/step_{at:08d}.json")
        if self.figures:
            fig = self._figures.draw(TRAIN_LOAD.lower(), lambda: fig_expert_load(expert_layers(line), at, TRAIN_LOAD))
            if fig is not None:
                self.client.log_figure(self.run_id, fig, f"atlas/figures/train_expert_load_{at:08d}.png")
                pyplot().close(fig)

    def log_rollout(self, line: dict[str, Any], metrics: dict[str, float], step: int) -> None:
        """A recorded step's rollout-agreement scalars at ``step`` (``atlas/rollout/...``, docs/rollout.md#trackers)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(k), float(v), now, int(step))
                                                    for k, v in metrics.items()])
        self._rollout.append(line)

    def alert(self, event: dict[str, Any]) -> None:
        from mlflow.entities import Metric, RunTag

        verdict = failed_event_verdict(event) or (gate_verdict(self._records[-1]) if self._records else None)
        self._alerts.append({**event, "verdict": verdict.headline() if verdict else "-"})
        tags = [RunTag("atlas.alert.level", event["level"]), RunTag("atlas.alert.title", tag_text(event["title"], clause=False)),
                RunTag("atlas.alert.step", str(event["step"])), RunTag("atlas.alert.count", str(len(self._alerts)))]
        if self._highest is None or ALERT_LEVELS.index(event["level"]) > ALERT_LEVELS.index(self._highest["level"]):
            self._highest = event
        tags += [RunTag("atlas.alert.max_level", self._highest["level"]),
                 RunTag("atlas.alert.max_title", tag_text(self._highest["title"], clause=False)),
                 RunTag("atlas.alert.max_step", str(self._highest["step"]))]
        tags += self._failed_tags(event)
        failed = failed_event_verdict(event)
        metrics = [] if failed is None else [Metric("atlas/verdict_code", float(LEVEL_CODES[failed.level]),
                                                    int(time.time() * 1000), int(event["step"]))]
        self.client.log_batch(self.run_id, tags=tags, metrics=metrics)
        text = "".join(json.dumps(a, allow_nan=False) + "\n" for a in self._alerts)
        self.client.log_text(self.run_id, text, "atlas/alerts.jsonl")
        self.client.log_text(self.run_id, alerts_page(self._alerts, f"atlas alerts: MLflow run {self.run_id}"),
                             ALERTS_TABLE)

    @staticmethod
    def _failed_tags(event: dict[str, Any]) -> list[Any]:
        """A gate failure sets ``atlas.verdict=FAILED`` and ``atlas.failed.*``; its clearing sets the count to 0
        (the next gate's own verdict is already tagged)."""
        from mlflow.entities import RunTag

        failed, verdict = event.get("failed"), failed_event_verdict(event)
        if failed is None:
            return []
        if verdict is None:  # cleared
            return [RunTag("atlas.failed.count", "0"), RunTag("atlas.failed.cleared_step", str(failed["cleared_step"]))]
        return [RunTag("atlas.verdict", verdict.level), RunTag("atlas.verdict.source", verdict.source),
                RunTag("atlas.failed.count", str(failed["count"])),
                RunTag("atlas.failed.first_step", str(failed["first_step"])),
                RunTag("atlas.failed.last_step", str(failed["last_step"])),
                RunTag("atlas.failed.layers", tag_text(", ".join(failed["layers"]) or "-", clause=False)),
                RunTag("atlas.failed.error", tag_text(failed["error"], clause=False))]

    def finish(self) -> None:
        """The HTML report, when a gate's upload was left to it; nothing to close: the run belongs to whoever
        created it."""
        if self._report_stale:
            self._upload_report()
