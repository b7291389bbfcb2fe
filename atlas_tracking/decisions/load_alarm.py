"""The alarm between gates: a sustained change in training-batch routing raises an alert and asks for a gate.

Each logging interval (a line of ``load.jsonl``) is read layer by layer (docs/telemetry.md#the-alarm):

- in **pretraining** the atlas is forming and its usage narrows legitimately, so only occupancy collapse puts a
  layer in breach, with the floors the gate policy uses (``policy.collapse_dead_fraction``,
  ``policy.collapse_effective_experts``);
- in **post-training** the first interval after the baseline gate is the reference, and a layer is in breach
  when, against it, experts that carried routes have none (``telemetry.new_dead``, where their reference share was at
  least ``telemetry.dead_min_share`` of the uniform share and at least ``telemetry.dead_min_expected`` routes were
  expected), an expert's share exceeds ``telemetry.share_bound`` times the uniform share having grown
  ``telemetry.share_growth``-fold, the load CV rose by more than ``telemetry.cv_rise``, or the normalised entropy fell
  by more than ``telemetry.entropy_drop`` (collapse counts too).

A layer in breach for ``telemetry.consecutive`` intervals in a row raises the alarm (a WARN alert naming the
layers, what crossed which bound and the experts involved) and, with ``telemetry.early_gate``, asks for a gate at
the next optimizer-step boundary. The alarm clears after as many intervals in a row without a breach (INFO).
It never moves the policy's stage: the gate it asks for does.

Example:
    >>> from atlas_tracking.schema.config import AtlasConfig
    >>> cfg = AtlasConfig.from_dict({"telemetry": {"consecutive": 2}})
    >>> alarm = LoadAlarm(cfg.telemetry, cfg.policy)
    >>> alarm.rebase(0)
    >>> line = lambda step, load: {"step": step, "layers": [{"layer": 3, "name": "l3", "load": load, "tokens": 500}]}
    >>> alarm.read(line(50, [125] * 8), pretraining=False).early_gate   # the reference interval
    False
    >>> for reason in alarm.read(line(100, [250] * 4 + [0] * 4), pretraining=False).breach[0]["reasons"]:
    ...     print(reason)
    experts 4, 5, 6 (+1 more) had routes in the reference interval and none now
    load CV 1.000, up 1.000 from 0.000 (bound 0.5)
    normalised entropy 0.667, down 0.333 from 1.000 (bound 0.1)
    >>> reading = alarm.read(line(150, [250] * 4 + [0] * 4), pretraining=False)
    >>> reading.early_gate, reading.alerts[0]["title"]
    (True, 'atlas: training-batch routing alarm at step 150')
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from atlas_tracking.decisions.alerts import AlertEvent
from atlas_tracking.decisions.phases import collapse_reasons
from atlas_tracking.receipts.experts import bounded_list, expert_shares
from atlas_tracking.receipts.load import layer_stats
from atlas_tracking.schema.config import PolicyConfig, TelemetryConfig

ALARM_KEY = "telemetry:alarm"
CLEARED_KEY = "telemetry:cleared"


@dataclass
class Reading:
    """What the alarm makes of one interval."""

    breach: list[dict[str, Any]] = field(default_factory=list)
    """The layers in breach at this interval (``layer``, ``name``, ``reasons``, ``experts``)."""
    alerts: list[dict[str, Any]] = field(default_factory=list)
    """Alerts raised at this interval (the alarm, its clearing)."""
    early_gate: bool = False
    """A gate is asked for at the next optimizer-step boundary."""
    standing: bool = False
    """An alarm stands after this interval."""
    alarm_layers: list[str] = field(default_factory=list)
    """The layers the standing alarm stands for (raised, not yet cleared)."""
    reference_step: int | None = None
    """Post-training: the step of the reference interval."""


def _top_k(row: dict[str, Any]) -> int | None:
    tokens = row.get("tokens") or 0
    return round(sum(row["load"]) / tokens) if tokens else None


class LoadAlarm:
    """Reads each interval's layers against the bounds; its state is a plain dict (checkpointed with the gate's)."""

    def __init__(self, telemetry: TelemetryConfig, policy: PolicyConfig, wait_duration_s: float = 300.0):
        self.cfg, self.policy, self.wait_duration_s = telemetry, policy, wait_duration_s
        self.reference: dict[str, list[int]] | None = None
        """Post-training: each layer's load in the reference interval (by layer name); None until the first
        interval after the baseline gate becomes it."""
        self.reference_step: int | None = None
        self.streak: dict[str, int] = {}
        """Per layer, intervals in a row in breach."""
        self.calm: dict[str, int] = {}
        """Per raised layer, intervals in a row without a breach."""
        self.raised: dict[str, int] = {}
        """Layers the alarm stands for, with the step it was raised at."""

    # --- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"reference": self.reference, "reference_step": self.reference_step,
                "streak": dict(self.streak), "calm": dict(self.calm), "raised": dict(self.raised)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reference = state.get("reference")
        self.reference_step = state.get("reference_step")
        self.streak = {k: int(v) for k, v in state.get("streak", {}).items()}
        self.calm = {k: int(v) for k, v in state.get("calm", {}).items()}
        self.raised = {k: int(v) for k, v in state.get("raised", {}).items()}

    def rebase(self, step: int) -> None:
        """A baseline gate at ``step``: the next interval becomes the reference, and the alarm starts afresh
        against it (an alarm that stood is read again from the new reference; the next line states it)."""
        self.reference, self.reference_step = None, None
        self.streak, self.calm, self.raised = {}, {}, {}

    # --- one interval --------------------------------------------------------------------------
    def _collapse(self, row: dict[str, Any]) -> list[str]:
        """The gate policy's collapse floors (:func:`~atlas_tracking.decisions.phases.collapse_reasons`) on the
        interval's load."""
        stats = layer_stats(row["load"])
        lay = {"name": row["name"], "num_experts": stats.experts, "top_k": _top_k(row), "dead_experts": len(stats.dead),
               "router_entropy": stats.entropy * math.log(stats.experts) if stats.experts > 1 else 0.0}
        return [r.removeprefix(f"{row['name']}: ") for r in collapse_reasons(
            [lay], self.policy.collapse_dead_fraction, self.policy.collapse_effective_experts)]

    def _against_reference(self, row: dict[str, Any], ref: list[int]) -> tuple[list[str], list[int]]:
        """What crossed which bound in ``row`` against the reference load ``ref``, and the experts involved."""
        c = self.cfg
        now, before = layer_stats(row["load"]), layer_stats(ref)
        load, base = np.asarray(row["load"], dtype=np.float64), np.asarray(ref, dtype=np.float64)
        reasons, experts = [], []
        uniform = 1.0 / max(len(load), 1)
        before_share, now_share = expert_shares(base), expert_shares(load)
        carried = (before_share > 0) & (before_share >= c.dead_min_share * uniform)
        died = [int(e) for e in np.flatnonzero(carried & (load == 0) & (before_share * load.sum() >= c.dead_min_expected))]
        if len(died) >= c.new_dead:
            reasons.append(f"experts {bounded_list(died)} had routes in the reference interval and none now")
            experts += died
        grown = now_share >= c.share_growth * before_share
        over = [int(e) for e in np.flatnonzero((now_share > c.share_bound * uniform) & grown)]
        if over:
            reasons.append(f"experts {bounded_list(over)} take more than {c.share_bound:g}x the uniform share, "
                           f"{c.share_growth:g}x or more their share at the reference (max {now.max_over_mean:.2f}x, "
                           f"{before.max_over_mean:.2f}x at the reference)")
            experts += over
        if now.cv - before.cv > c.cv_rise:
            reasons.append(f"load CV {now.cv:.3f}, up {now.cv - before.cv:.3f} from {before.cv:.3f} (bound "
                           f"{c.cv_rise:g})")
        if before.entropy - now.entropy > c.entropy_drop:
            reasons.append(f"normalised entropy {now.entropy:.3f}, down {before.entropy - now.entropy:.3f} from "
                           f"{before.entropy:.3f} (bound {c.entropy_drop:g})")
        return reasons, experts

    def read(self, line: dict[str, Any], pretraining: bool) -> Reading:
        """Read one interval (a ``load.jsonl`` line) in the run's current phase."""
        step = int(line["step"])
        rows = [row for row in line["layers"] if sum(row["load"]) > 0]
        reference = None if pretraining else self.reference
        if not pretraining and self.reference is None and rows:  # the first interval after the baseline gate
            self.reference = {row["name"]: list(row["load"]) for row in rows}
            self.reference_step = step
        breach = []
        for row in rows:
            reasons, experts = self._collapse(row), []
            ref = None if reference is None else reference.get(row["name"])
            if ref is not None and len(ref) == len(row["load"]):
                more, experts = self._against_reference(row, ref)
                reasons += more
            if reasons:
                breach.append({"layer": row["layer"], "name": row["name"], "reasons": reasons,
                               "experts": sorted(set(experts))})
        return self._advance(step, breach)

    def _advance(self, step: int, breach: list[dict[str, Any]]) -> Reading:
        need = self.cfg.consecutive
        names = {b["name"] for b in breach}
        for name in set(self.streak) | names:
            self.streak[name] = self.streak.get(name, 0) + 1 if name in names else 0
        newly = [b for b in breach if self.streak[b["name"]] >= need and b["name"] not in self.raised]
        for b in newly:
            self.raised[b["name"]] = step
        cleared = []
        for name in list(self.raised):
            self.calm[name] = 0 if name in names else self.calm.get(name, 0) + 1
            if self.calm[name] >= need:
                cleared.append(name)
                del self.raised[name], self.calm[name]
        reading = Reading(breach=breach, standing=bool(self.raised), reference_step=self.reference_step,
                          alarm_layers=sorted(self.raised))
        if newly:
            reading.early_gate = self.cfg.early_gate
            reading.alerts.append(self._alarm(step, newly).to_dict())
        if cleared:
            reading.alerts.append(AlertEvent(
                f"atlas: training-batch routing alarm cleared at step {step}",
                f"No breach for {need} intervals in a row on {', '.join(cleared)}.", "INFO", CLEARED_KEY, step,
                self.wait_duration_s).to_dict())
        return reading

    def _alarm(self, step: int, layers: list[dict[str, Any]]) -> AlertEvent:
        where = "; ".join(f"{b['name']} (layer {b['layer']}): {', '.join(b['reasons'])}" for b in layers)
        then = (" An early gate runs at the next optimizer-step boundary; its reading, not this alarm, moves the "
                "stage." if self.cfg.early_gate else " telemetry.early_gate is off: the next scheduled gate reads it.")
        against = (f" against the reference interval ending at step {self.reference_step}"
                   if self.reference_step is not None else "")
        text = (f"Training-batch routing stayed in breach for {self.cfg.consecutive} intervals{against}: {where}."
                f"{then}")
        return AlertEvent(f"atlas: training-batch routing alarm at step {step}", text, "WARN", ALARM_KEY, step,
                          self.wait_duration_s)
