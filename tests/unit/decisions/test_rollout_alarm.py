"""The rollout-agreement alarm and its configuration: bounds, clearing, a sustained rise, and noise that is not one."""

from __future__ import annotations

import pytest

from atlas_tracking import AtlasConfig, ConfigError
from atlas_tracking.decisions.rollout_alarm import RolloutAlarm


def line(step, mismatches, fallback=0, tokens=100):
    return {"step": step, "layers": [{"layer": 2 * i + 1, "name": f"l{2 * i + 1}", "tokens": tokens,
                                      "fallback": fallback, "mismatch": m} for i, m in enumerate(mismatches)]}


def alarm(**rollout):
    return RolloutAlarm(AtlasConfig.from_dict({"rollout": rollout}).rollout)


def test_a_layer_past_the_bound_alerts_once_while_it_stays_and_clears_when_none_is():
    a = alarm(mismatch_bound=0.05, rise_steps=0)
    assert a.read(line(1, [0.01, 0.02])).alerts == []
    first = a.read(line(2, [0.01, 0.08]))
    assert [b["name"] for b in first.breach] == ["l3"] and first.standing
    assert [e["level"] for e in first.alerts] == ["WARN"] and "l3 (layer 3): mismatch 0.0800" in first.alerts[0]["text"]
    assert a.read(line(3, [0.01, 0.09])).alerts == []                          # still in breach: no second alert
    more = a.read(line(4, [0.06, 0.09]))
    assert [e["key"] for e in more.alerts] == ["rollout:bound"] and "l1 (layer 1)" in more.alerts[0]["text"]
    calm = a.read(line(5, [0.01, 0.01]))
    assert [e["level"] for e in calm.alerts] == ["INFO"] and not calm.standing


def test_a_bound_exactly_met_is_no_breach():
    assert alarm(mismatch_bound=0.05).read(line(1, [0.05])).breach == []


def test_fallback_past_its_bound_is_a_breach():
    reading = alarm(fallback_bound=0.01).read(line(1, [0.0], fallback=2))
    assert reading.breach[0]["reasons"] == ["fallback 0.0200 of the positions (a rollout route that cannot be used) "
                                            "above rollout.fallback_bound 0.01"]


def test_a_sustained_rise_alerts_once_and_rearms_after_a_step_that_does_not_rise():
    a = alarm(rise_steps=3, rise_min=0.02)
    got = [a.read(line(s, [m])) for s, m in enumerate([0.01, 0.02, 0.03, 0.04, 0.05, 0.04, 0.05, 0.06, 0.07], 1)]
    keys = [[e["key"] for e in r.alerts] for r in got]
    assert keys == [[], [], [], ["rollout:rise"], [], [], [], [], ["rollout:rise"]]
    assert [r.rising for r in got] == [0, 1, 2, 3, 4, 0, 1, 2, 3]


def test_a_rise_smaller_than_rise_min_is_noise():
    a = alarm(rise_steps=3, rise_min=0.02)
    got = [a.read(line(s, [m])) for s, m in enumerate([0.010, 0.011, 0.013, 0.014], 1)]
    assert got[-1].rising == 3 and got[-1].alerts == []


def test_the_state_survives_a_checkpoint():
    a = alarm(mismatch_bound=0.05)
    a.read(line(1, [0.08]))
    b = alarm(mismatch_bound=0.05)
    b.load_state_dict(a.state_dict())
    assert b.read(line(2, [0.09])).alerts == []


@pytest.mark.parametrize("section, error", [
    ({"mismatch_bound": 1.5}, r"'rollout\.mismatch_bound' must be in \[0\.0, 1\.0\], got 1\.5"),
    ({"fallback_bound": float("nan")}, r"'rollout\.fallback_bound' must be in"),
    ({"every_n_steps": 0}, r"'rollout\.every_n_steps' must be >= 1"),
    ({"rise_steps": -1}, r"'rollout\.rise_steps' must be >= 0"),
    ({"rise_min": float("nan")}, r"'rollout\.rise_min' must be >= 0"),
])
def test_bad_configuration_names_the_key(section, error):
    with pytest.raises(ConfigError, match=error):
        AtlasConfig.from_dict({"rollout": section})
