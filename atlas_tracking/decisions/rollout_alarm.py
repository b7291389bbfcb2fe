"""The rollout-agreement alarm: a layer whose routing disagrees with the rollout engine's beyond a bound, or a
disagreement that keeps rising, raises an alert (docs/rollout.md#the-alarm).

Each recorded step (a line of ``rollout.jsonl``) is read layer by layer: a layer is in breach when its mismatch
exceeds ``rollout.mismatch_bound`` or its fallback share (positions whose rollout route could not be used) exceeds
``rollout.fallback_bound``. A layer newly in breach raises a WARN alert naming it and the figure; the alert
clears (INFO) at the first recorded step where no layer is in breach. Separately, when the worst layer's mismatch
rose at each of the last ``rollout.rise_steps`` recorded steps, by ``rollout.rise_min`` or more in all, a WARN
alert says so once, re-armed by a step at which it did not rise. The alarm moves no stage: gates do.

Example:
    >>> from atlas_tracking.schema.config import AtlasConfig
    >>> alarm = RolloutAlarm(AtlasConfig.from_dict({"rollout": {"mismatch_bound": 0.05}}).rollout)
    >>> line = lambda step, m: {"step": step, "layers": [
    ...     {"layer": 3, "name": "l3", "tokens": 100, "fallback": 0, "mismatch": m}]}
    >>> alarm.read(line(1, 0.01)).alerts
    []
    >>> reading = alarm.read(line(2, 0.08))
    >>> reading.breach[0]["reasons"], reading.alerts[0]["title"]
    (['mismatch 0.0800 above rollout.mismatch_bound 0.05'], 'atlas: rollout routing disagrees at step 2')
    >>> alarm.read(line(3, 0.02)).alerts[0]["level"]
    'INFO'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from atlas_tracking.decisions.alerts import AlertEvent
from atlas_tracking.schema.config import RolloutConfig

BOUND_KEY = "rollout:bound"
CLEARED_KEY = "rollout:cleared"
RISE_KEY = "rollout:rise"


@dataclass
class Reading:
    """What the alarm makes of one recorded step."""

    breach: list[dict[str, Any]] = field(default_factory=list)
    rising: int = 0
    """Consecutive recorded steps, up to this one, at which the worst layer's mismatch rose."""
    alerts: list[dict[str, Any]] = field(default_factory=list)
    standing: bool = False
    """A bound stays crossed, or a sustained rise was raised and has not stopped."""


def worst_mismatch(line: dict[str, Any]) -> float | None:
    """The largest per-layer mismatch of a line (None when no layer compared a position)."""
    values = [row["mismatch"] for row in line["layers"] if row.get("mismatch") is not None]
    return max(values) if values else None


class RolloutAlarm:
    """Reads each recorded step's layers against the bounds; its state is a plain dict (checkpointed with the
    gate's)."""

    def __init__(self, cfg: RolloutConfig, wait_duration_s: float = 300.0):
        self.cfg, self.wait_duration_s = cfg, wait_duration_s
        self.raised: list[str] = []
        """The layers in breach at the last recorded step, once an alert named them."""
        self.worst: list[float] = []
        """The worst layer's mismatch at the last ``rise_steps + 1`` recorded steps."""
        self.rising = 0
        """Consecutive recorded steps at which the worst layer's mismatch rose."""
        self.rise_raised = False

    def state_dict(self) -> dict[str, Any]:
        return {"raised": list(self.raised), "worst": list(self.worst), "rising": self.rising,
                "rise_raised": self.rise_raised}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.raised = [str(name) for name in state.get("raised", [])]
        self.worst = [float(v) for v in state.get("worst", [])]
        self.rising = int(state.get("rising", 0))
        self.rise_raised = bool(state.get("rise_raised", False))

    def _reasons(self, row: dict[str, Any]) -> list[str]:
        c, reasons = self.cfg, []
        if row.get("mismatch") is not None and row["mismatch"] > c.mismatch_bound:
            reasons.append(f"mismatch {row['mismatch']:.4f} above rollout.mismatch_bound {c.mismatch_bound:g}")
        share = row["fallback"] / row["tokens"] if row.get("tokens") else 0.0
        if share > c.fallback_bound:
            reasons.append(f"fallback {share:.4f} of the positions (a rollout route that cannot be used) above "
                           f"rollout.fallback_bound {c.fallback_bound:g}")
        return reasons

    def read(self, line: dict[str, Any]) -> Reading:
        """Read one recorded step (a ``rollout.jsonl`` line)."""
        step = int(line["step"])
        breach = [{"layer": row["layer"], "name": row["name"], "reasons": reasons}
                  for row in line["layers"] if (reasons := self._reasons(row))]
        reading = Reading(breach=breach)
        newly = [b for b in breach if b["name"] not in self.raised]
        if newly:
            where = "; ".join(f"{b['name']} (layer {b['layer']}): {', '.join(b['reasons'])}" for b in newly)
            reading.alerts.append(AlertEvent(
                f"atlas: rollout routing disagrees at step {step}",
                f"The trainer routes the rollout's tokens differently from the rollout engine: {where}. The update "
                "is off-policy there; replaying the rollout's routes, or matching the two engines' precision, "
                "removes it (docs/rollout.md#the-alarm).", "WARN", BOUND_KEY, step, self.wait_duration_s).to_dict())
        if self.raised and not breach:
            reading.alerts.append(AlertEvent(
                f"atlas: rollout routing agrees again at step {step}",
                f"No layer is beyond the rollout bounds at step {step} ({', '.join(self.raised)} were).", "INFO",
                CLEARED_KEY, step, self.wait_duration_s).to_dict())
        self.raised = [b["name"] for b in breach]
        reading.rising = self._rise(step, worst_mismatch(line), reading)
        reading.standing = bool(self.raised) or self.rise_raised
        return reading

    def _rise(self, step: int, worst: float | None, reading: Reading) -> int:
        """Track the worst layer's mismatch; the count of consecutive rises up to this step."""
        if worst is None:
            return self.rising
        rose = bool(self.worst) and worst > self.worst[-1]
        self.rising = self.rising + 1 if rose else 0
        self.worst = [*self.worst, worst][-(self.cfg.rise_steps + 1):]
        if not rose:
            self.rise_raised = False
        need = self.cfg.rise_steps
        if need and self.rising >= need and not self.rise_raised and self.worst[-1] - self.worst[0] >= self.cfg.rise_min:
            self.rise_raised = True
            reading.alerts.append(AlertEvent(
                f"atlas: rollout routing disagreement rising at step {step}",
                f"The worst layer's mismatch rose at each of the last {need} recorded steps, from "
                f"{self.worst[0]:.4f} to {self.worst[-1]:.4f} (rollout.rise_steps {need}, rollout.rise_min "
                f"{self.cfg.rise_min:g}): the trainer and the rollout engine are drifting apart "
                "(docs/rollout.md#the-alarm).", "WARN", RISE_KEY, step, self.wait_duration_s).to_dict())
        return self.rising
