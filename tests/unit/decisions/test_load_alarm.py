"""The alarm between gates (decisions/load_alarm.py) against a reference written from its docstring and the
``telemetry`` / ``policy.collapse_*`` config docs with plain loops: which layers are in breach and why, which
experts, when the alarm is raised and cleared, the early-gate request, the phases, rebase and checkpoint round
trips; and on sampled routes: a healthy multinomial run never breaches, a planted collapse raises in two intervals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from atlas_tracking.decisions.load_alarm import ALARM_KEY, CLEARED_KEY, LoadAlarm
from atlas_tracking.schema.config import AtlasConfig, PolicyConfig, TelemetryConfig

TOL = 1e-9
"""A bound this close to the compared value is a tie the floating-point order may settle either way: such
examples are left out of the randomised comparison (decided exactly in the hand-made ones)."""

KINDS = {  # what each reason's text says -> the rule that put the layer in breach
    "had routes in the reference interval and none now": "new_dead",
    "the uniform share": "share",
    "load CV": "cv",
    "normalised entropy": "entropy",
    "experts dead (more than": "dead_floor",
    "effective experts exp(H)": "effective",
}


def kinds(reasons: list[str]) -> set[str]:
    out = set()
    for reason in reasons:
        found = [kind for text, kind in KINDS.items() if text in reason]
        assert len(found) == 1, reason
        out |= set(found)
    return out


# --- the reference ---------------------------------------------------------------------------------------------


def _cv(load):
    mean = sum(load) / len(load)
    return math.sqrt(sum((x - mean) ** 2 for x in load) / len(load)) / mean if mean > 0 else 0.0


def _entropy_nats(load):
    total, h = sum(load), 0.0
    for x in load:
        if x > 0:
            h -= x / total * math.log(x / total)
    return h


def _near(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(a), abs(b))


class RefAlarm:
    """The rules as the docs state them, one loop per rule; ``ties`` counts comparisons too close to call."""

    def __init__(self, cfg: TelemetryConfig, policy: PolicyConfig):
        self.cfg, self.policy = cfg, policy
        self.reference, self.reference_step = None, None
        self.streak, self.calm, self.raised = {}, {}, []
        self.ties = 0

    def rebase(self):
        self.reference, self.reference_step = None, None
        self.streak, self.calm, self.raised = {}, {}, []

    def _more(self, a, b):
        """a > b, counting a near tie."""
        self.ties += _near(a, b)
        return a > b

    def _every(self, *tests):
        """All of ``(holds, near a tie)``, counting a tie only where it decides."""
        if all(holds or tied for holds, tied in tests) and any(tied for _, tied in tests):
            self.ties += 1
        return all(holds for holds, _ in tests)

    def layer(self, row, ref):
        c, p = self.cfg, self.policy
        load, n, total = row["load"], len(row["load"]), sum(row["load"])
        found, experts = set(), set()
        # the collapse floors (both phases): dead experts over a fraction; exp(H) below a multiple of top-k
        if sum(1 for x in load if x == 0) > p.collapse_dead_fraction * n:
            found.add("dead_floor")
        if row.get("tokens"):
            k = round(total / row["tokens"])
            if n > 1 and self._more(p.collapse_effective_experts * k, math.exp(_entropy_nats(load))):
                found.add("effective")
            if n == 1 and p.collapse_effective_experts * k > 1:  # one expert: exp(H) = 1
                found.add("effective")
        if ref is None or len(ref) != n:
            return found, experts
        rtotal = sum(ref)
        # newly dead: carried routes at a share of at least dead_min_share / E, at least dead_min_expected of
        # this interval's routes expected from that share, and none now
        died = [e for e in range(n) if load[e] == 0 and ref[e] > 0 and self._every(
            (ref[e] / rtotal >= c.dead_min_share / n, _near(ref[e] / rtotal, c.dead_min_share / n)),
            (ref[e] / rtotal * total >= c.dead_min_expected, _near(ref[e] / rtotal * total, c.dead_min_expected)))]
        if len(died) >= c.new_dead:
            found.add("new_dead")
            experts |= set(died)
        # overloaded: over share_bound / E, and share_growth times the reference share or more
        over = [e for e in range(n) if self._every(
            (load[e] / total > c.share_bound / n, _near(load[e] / total, c.share_bound / n)),
            (load[e] / total >= c.share_growth * ref[e] / rtotal, _near(load[e] / total, c.share_growth * ref[e] / rtotal)))]
        if over:
            found.add("share")
            experts |= set(over)
        if self._more(_cv(load) - _cv(ref), c.cv_rise):
            found.add("cv")
        if n > 1 and self._more(_entropy_nats(ref) / math.log(n) - _entropy_nats(load) / math.log(n), c.entropy_drop):
            found.add("entropy")
        return found, experts

    def read(self, line, pretraining):
        rows = [r for r in line["layers"] if sum(r["load"]) > 0]
        against = None if pretraining else self.reference
        if not pretraining and self.reference is None and rows:
            self.reference = {r["name"]: list(r["load"]) for r in rows}
            self.reference_step = line["step"]
        breach = []
        for row in rows:
            ref = against.get(row["name"]) if against else None
            found, experts = self.layer(row, ref)
            if found:
                breach.append((row["layer"], row["name"], found, sorted(experts)))
        names = [b[1] for b in breach]
        for name in set(self.streak) | set(names):
            self.streak[name] = self.streak.get(name, 0) + 1 if name in names else 0
        newly = [b for b in breach if self.streak[b[1]] >= self.cfg.consecutive and b[1] not in self.raised]
        self.raised += [b[1] for b in newly]
        cleared = []
        for name in list(self.raised):
            self.calm[name] = 0 if name in names else self.calm.get(name, 0) + 1
            if self.calm[name] >= self.cfg.consecutive:
                cleared.append(name)
                self.raised.remove(name)
                del self.calm[name]
        alerts = ([("WARN", ALARM_KEY)] if newly else []) + ([("INFO", CLEARED_KEY)] if cleared else [])
        return {"breach": breach, "alerts": alerts, "early_gate": bool(newly) and self.cfg.early_gate,
                "standing": bool(self.raised), "reference_step": self.reference_step, "newly": newly,
                "cleared": cleared}


def check(reading, ref, step):
    """The module's reading equals the reference's."""
    got = [(b["layer"], b["name"], kinds(b["reasons"]), b["experts"]) for b in reading.breach]
    assert got == ref["breach"], step
    assert [(a["level"], a["key"]) for a in reading.alerts] == ref["alerts"], step
    assert (reading.early_gate, reading.standing, reading.reference_step) == (
        ref["early_gate"], ref["standing"], ref["reference_step"]), step
    for alert in reading.alerts:
        assert alert["step"] == step
        if alert["key"] == ALARM_KEY:  # names every newly raised layer, what crossed which bound, the experts
            for layer, name, _, experts in ref["newly"]:
                assert f"{name} (layer {layer})" in alert["text"]
                for e in experts[:3]:
                    assert str(e) in alert["text"]
            for b in reading.breach:
                if b["name"] in [n for _, n, _, _ in ref["newly"]]:
                    assert all(reason in alert["text"] for reason in b["reasons"])
        else:
            assert all(name in alert["text"] for name in ref["cleared"])


# --- randomised: sequences of intervals, phases and baseline gates ---------------------------------------------


def _row(draw, i, experts):
    shape = draw(st.sampled_from(["even", "noisy", "two", "one", "some_dead", "skewed", "none", "free"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    routes = draw(st.sampled_from([8, 40, 400, 4000]))
    if shape == "even":
        load = [routes // experts] * experts
    elif shape == "noisy":
        load = rng.multinomial(routes, np.full(experts, 1 / experts)).tolist()
    elif shape == "two":
        load = [routes // 2, routes // 2] + [0] * (experts - 2)
    elif shape == "one":
        load = [0] * experts
        load[draw(st.integers(0, experts - 1))] = routes
    elif shape == "some_dead":
        alive = draw(st.integers(1, experts))
        load = rng.multinomial(routes, np.full(alive, 1 / alive)).tolist() + [0] * (experts - alive)
    elif shape == "skewed":
        load = rng.multinomial(routes, rng.dirichlet(np.full(experts, 0.3))).tolist()
    elif shape == "none":
        load = [0] * experts
    else:
        load = draw(st.lists(st.integers(0, 60), min_size=experts, max_size=experts))
    k = draw(st.sampled_from([1, 2]))
    return {"layer": 2 * i + 1, "name": f"model.layers.{2 * i + 1}.mlp", "load": load,
            "tokens": sum(load) // k if draw(st.booleans()) else draw(st.integers(0, 50))}


@st.composite
def runs(draw):
    telemetry = TelemetryConfig(
        consecutive=draw(st.integers(1, 3)), early_gate=draw(st.booleans()), new_dead=draw(st.integers(1, 3)),
        dead_min_expected=draw(st.sampled_from([0.5, 10.0, 60.0])), dead_min_share=draw(st.sampled_from([0.0, 0.25, 0.9])),
        share_bound=draw(st.sampled_from([1.5, 2.0, 4.0])), share_growth=draw(st.sampled_from([1.0, 2.0, 3.0])),
        cv_rise=draw(st.sampled_from([0.1, 0.5, 2.0])), entropy_drop=draw(st.sampled_from([0.02, 0.1, 0.5])))
    policy = PolicyConfig(collapse_dead_fraction=draw(st.sampled_from([0.25, 0.75])),
                          collapse_effective_experts=draw(st.sampled_from([0.0, 1.0, 2.0])))
    widths = draw(st.lists(st.sampled_from([1, 4, 8]), min_size=1, max_size=3))
    events = []
    for n in range(draw(st.integers(1, 9))):
        if draw(st.integers(0, 5)) == 0:
            events.append(("rebase", 10 * n))
        line = {"step": 10 * n + 10, "layers": [_row(draw, i, e) for i, e in enumerate(widths)]}
        events.append(("read", line, draw(st.sampled_from([False, False, True]))))
    return telemetry, policy, events


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(runs())
def test_every_reading_equals_the_reference(run):
    telemetry, policy, events = run
    alarm, ref = LoadAlarm(telemetry, policy), RefAlarm(telemetry, policy)
    for event in events:
        if event[0] == "rebase":
            alarm.rebase(event[1])
            ref.rebase()
            continue
        _, line, pretraining = event
        expected = ref.read(line, pretraining)
        assume(ref.ties == 0)
        check(alarm.read(line, pretraining), expected, line["step"])


# --- the rules, by hand ----------------------------------------------------------------------------------------


def _line(step, *loads, tokens=None):
    return {"step": step, "layers": [{"layer": i, "name": f"l{i}", "load": list(load),
                                      "tokens": tokens if tokens is not None else sum(load) // 2}
                                     for i, load in enumerate(loads)]}


def _alarm(**telemetry):
    cfg = AtlasConfig.from_dict({"telemetry": telemetry})
    alarm = LoadAlarm(cfg.telemetry, cfg.policy)
    alarm.rebase(0)
    return alarm


def _kinds(reading):
    return {b["name"]: kinds(b["reasons"]) for b in reading.breach}


def test_new_dead_only_where_enough_routes_were_expected():
    ref = [500, 500, 500, 500, 500, 500, 100, 100]  # 3200 routes: experts 6 and 7 at a share of 1/32
    quiet = dict(consecutive=1, cv_rise=10.0, entropy_drop=1.0, share_bound=8.0, dead_min_share=0.0)
    alarm = _alarm(**quiet)
    alarm.read(_line(10, ref), pretraining=False)
    # 320 routes now: expert 7 was expected 320 / 32 = 10 routes (>= dead_min_expected 10: it counts)
    at_bound = [50, 50, 50, 50, 50, 50, 20, 0]
    reading = alarm.read(_line(20, at_bound), pretraining=False)
    assert _kinds(reading) == {"l0": {"new_dead"}} and reading.breach[0]["experts"] == [7]
    below = [50, 50, 50, 50, 50, 50, 19, 0]  # 319 routes: 9.97 expected, no evidence
    assert _kinds(alarm.read(_line(30, below), pretraining=False)) == {}
    two = _alarm(**{**quiet, "new_dead": 2})
    two.read(_line(10, ref), pretraining=False)
    assert _kinds(two.read(_line(20, at_bound), pretraining=False)) == {}  # one newly dead expert: under new_dead
    assert two.read(_line(30, [60] * 6 + [0, 0]), pretraining=False).breach[0]["experts"] == [6, 7]
    # an expert dead at the reference is not newly dead
    ref_dead = [100] * 7 + [0]
    gone = _alarm(**quiet)
    gone.read(_line(10, ref_dead), pretraining=False)
    assert _kinds(gone.read(_line(20, ref_dead), pretraining=False)) == {}


def test_new_dead_only_where_the_reference_share_was_not_already_near_silent():
    ref = [550, 550, 550, 550, 550, 550, 100, 50]  # 3400 routes: expert 6 at 0.235 x uniform, expert 7 at 0.118 x
    quiet = dict(consecutive=1, cv_rise=10.0, entropy_drop=1.0, share_bound=8.0)
    for floor, died in ((0.25, []), (0.2, [6]), (0.1, [6, 7])):
        alarm = _alarm(**quiet, dead_min_share=floor)
        alarm.read(_line(10, ref), pretraining=False)
        reading = alarm.read(_line(20, [1100] * 6 + [0, 0]), pretraining=False)  # expected 200 and 100 routes
        assert [b["experts"] for b in reading.breach] == ([died] if died else []), floor
    # exactly at the floor counts: a share of 1/32 with E = 8 is 0.25 x uniform
    alarm = _alarm(**quiet, dead_min_share=0.25)
    alarm.read(_line(10, [500] * 6 + [100, 100]), pretraining=False)
    assert alarm.read(_line(20, [500] * 6 + [100, 0]), pretraining=False).breach[0]["experts"] == [7]


def test_overloaded_experts_over_the_bound_having_grown():
    alarm = _alarm(consecutive=1, cv_rise=10.0, entropy_drop=1.0, share_bound=2.0, share_growth=2.0)
    alarm.read(_line(10, [300, 100, 100, 100, 100, 100, 100, 100]), pretraining=False)  # expert 0 at 0.3 > 2/8
    # expert 0 over the bound but not twice its 0.3; expert 1 twice its 0.1 but exactly at the bound 0.25
    assert _kinds(alarm.read(_line(20, [400, 250, 50, 50, 50, 50, 50, 100]), pretraining=False)) == {}
    reading = alarm.read(_line(30, [400, 260, 50, 50, 50, 50, 40, 100]), pretraining=False)
    assert _kinds(reading) == {"l0": {"share"}} and reading.breach[0]["experts"] == [1]
    # expert 0, over the bound at the reference already, at twice its share (0.6): overloaded too
    reading = alarm.read(_line(40, [600, 200, 40, 40, 40, 40, 20, 20]), pretraining=False)
    assert "share" in _kinds(reading)["l0"] and reading.breach[0]["experts"] == [0]  # expert 1 at 0.2: under
    # growth 1: any expert over the bound that did not shrink
    flat = _alarm(consecutive=1, cv_rise=10.0, entropy_drop=1.0, share_bound=2.0, share_growth=1.0)
    flat.read(_line(10, [300, 100, 100, 100, 100, 100, 100, 100]), pretraining=False)
    assert flat.read(_line(20, [300, 100, 100, 100, 100, 100, 100, 100]), pretraining=False).breach[0]["experts"] == [0]
    assert flat.read(_line(30, [290, 110, 100, 100, 100, 100, 100, 100]), pretraining=False).breach == []


def test_cv_rise_and_entropy_drop_bounds():
    base = [100] * 8
    alarm = _alarm(consecutive=1, share_bound=8.0, cv_rise=0.5, entropy_drop=0.1)
    alarm.read(_line(10, base), pretraining=False)
    # CV 0.5 exactly (std 50 over mean 100): not above the bound; entropy barely lower
    assert _kinds(alarm.read(_line(20, [150] * 4 + [50] * 4), pretraining=False)) == {}
    assert _kinds(alarm.read(_line(30, [160] * 4 + [40] * 4), pretraining=False)) == {"l0": {"cv"}}
    # entropy 1 - 0.1 and under; the first rule the docs give: a fall of more than entropy_drop
    low = [700, 20, 20, 20, 20, 20, 0, 0]  # entropy 0.28 (and two newly dead experts, exp(H) 1.8 < 2 x 2)
    assert _kinds(alarm.read(_line(40, low), pretraining=False)) == {"l0": {"entropy", "cv", "new_dead", "effective"}}


def test_pretraining_reads_the_collapse_floors_only():
    cfg = AtlasConfig.from_dict({"telemetry": {"consecutive": 1}})
    alarm = LoadAlarm(cfg.telemetry, cfg.policy)  # policy: dead fraction 0.75, effective experts 2 x top-k
    skewed = [300, 10, 10, 10, 10, 10, 10, 10]  # CV and share far from the first interval's: no collapse
    assert alarm.read(_line(10, [100] * 8), pretraining=True).breach == []
    assert alarm.read(_line(20, skewed, tokens=370), pretraining=True).breach == []  # top-k 1: exp(H) 2.35 >= 2
    # the same routes over 185 tokens (top-k 2): exp(H) 2.35 < 4
    assert _kinds(alarm.read(_line(30, skewed, tokens=185), pretraining=True)) == {"l0": {"effective"}}
    # twelve of sixteen dead is not more than 0.75 of them; thirteen is
    assert _kinds(alarm.read(_line(40, [25] * 4 + [0] * 12, tokens=100), pretraining=True)) == {}
    assert _kinds(alarm.read(_line(50, [25] * 3 + [0] * 13, tokens=75), pretraining=True)) == {"l0": {"dead_floor"}}
    assert alarm.reference is None  # pretraining takes no reference


def test_consecutive_intervals_raise_and_clear_with_one_alert_each():
    alarm = _alarm(consecutive=3)
    even, bad = [100] * 8, [400, 400] + [0] * 6
    assert alarm.read(_line(10, even, even), pretraining=False).reference_step == 10
    readings = [alarm.read(_line(20 + 10 * i, bad, even), pretraining=False) for i in range(5)]
    assert [len(r.breach) for r in readings] == [1] * 5
    assert [r.early_gate for r in readings] == [False, False, True, False, False]
    assert [[a["key"] for a in r.alerts] for r in readings] == [[], [], [ALARM_KEY], [], []]
    warn = readings[2].alerts[0]
    assert warn["level"] == "WARN" and warn["step"] == 40 and "l0 (layer 0)" in warn["text"] and "l1" not in warn["text"]
    assert "experts 2, 3, 4 (+3 more) had routes" in warn["text"] and "reference interval ending at step 10" in warn["text"]
    # a calm interval between breaches resets the calm count; three calm ones in a row clear it
    seq = [even, bad, even, even, even]
    after = [alarm.read(_line(100 + 10 * i, load, even), pretraining=False) for i, load in enumerate(seq)]
    assert [r.standing for r in after] == [True, True, True, True, False]
    assert [[(a["level"], a["key"]) for a in r.alerts] for r in after][-1] == [("INFO", CLEARED_KEY)]
    assert sum(len(r.alerts) for r in after) == 1 and "l0" in after[-1].alerts[0]["text"]
    # the second layer raised while the first stands: its own alert, one early gate each
    both = [alarm.read(_line(200 + 10 * i, bad, bad), pretraining=False) for i in range(3)]
    assert [r.early_gate for r in both] == [False, False, True]
    assert "l0 (layer 0)" in both[2].alerts[0]["text"] and "l1 (layer 1)" in both[2].alerts[0]["text"]
    late = [alarm.read(_line(300 + 10 * i, even, bad), pretraining=False) for i in range(3)]
    assert [r.alerts for r in late[:2]] == [[], []] and late[2].alerts[0]["key"] == CLEARED_KEY
    assert late[2].standing  # l1 stands


def test_early_gate_off_raises_without_asking_for_a_gate():
    alarm = _alarm(consecutive=1, early_gate=False)
    alarm.read(_line(10, [100] * 8), pretraining=False)
    reading = alarm.read(_line(20, [400, 400] + [0] * 6), pretraining=False)
    assert not reading.early_gate and reading.alerts[0]["key"] == ALARM_KEY
    assert "telemetry.early_gate is off" in reading.alerts[0]["text"]


def test_rebase_starts_afresh():
    alarm = _alarm(consecutive=2)
    even, two = [100] * 8, [400, 400] + [0] * 6
    alarm.read(_line(10, even), pretraining=False)
    alarm.read(_line(20, two), pretraining=False)
    assert alarm.read(_line(30, two), pretraining=False).standing
    alarm.rebase(30)  # a baseline gate at 30: the next interval is the reference
    first = alarm.read(_line(40, two), pretraining=False)
    assert first.reference_step == 40 and not first.standing
    assert _kinds(first) == {"l0": {"effective"}}  # collapse still counts; nothing against the new reference
    again = alarm.read(_line(50, two), pretraining=False)
    assert again.standing and again.alerts[0]["key"] == ALARM_KEY and "step 40" in again.alerts[0]["text"]


def test_state_dict_round_trip_mid_streak_reads_the_same_future():
    rng = np.random.default_rng(3)
    good, bad = rng.dirichlet(np.full(16, 5.0)), np.zeros(16)
    bad[[3, 9]] = 0.5
    lines = [{"step": 10 * (i + 1), "layers": [
        {"layer": j, "name": f"l{j}", "load": rng.multinomial(5000, good if kind == "G" else bad).tolist(),
         "tokens": 2500} for j in range(2)]} for i, kind in enumerate("GGBBBGGGBBB")]
    one = _alarm(consecutive=3)
    for x in lines[:3]:  # the reference, a calm interval, then one in breach: a streak under way
        one.read(x, pretraining=False)
    assert one.streak == {"l0": 1, "l1": 1}
    two = LoadAlarm(one.cfg, one.policy)
    two.load_state_dict(json.loads(json.dumps(one.state_dict())))
    a = [one.read(x, pretraining=False) for x in lines[3:]]
    b = [two.read(x, pretraining=False) for x in lines[3:]]
    assert a == b
    assert [[x["key"] for x in r.alerts] for r in a] == [[], [ALARM_KEY], [], [], [CLEARED_KEY], [], [], [ALARM_KEY]]


# --- sampled routes: no false alarm on a healthy run, a planted collapse in two intervals ----------------------

EXPERTS, TOP_K = 32, 2


def _healthy(rng, layers=4):
    """Fixed, uneven but healthy shares per layer: the busiest at most about 2.4x uniform, two near silent at 0.02x
    (an expected 2.6 routes in 4096: often none, and no news) and two quiet at 0.3x (4.8 expected in 512 routes:
    often none, which so short an interval does not show)."""
    out = []
    for _ in range(layers):
        p = np.clip(rng.dirichlet(np.full(EXPERTS, 3.0)), 0.02 / EXPERTS, 2.4 / EXPERTS)
        p[:2], p[2:4] = 0.02 / EXPERTS, 0.3 / EXPERTS
        out.append(p / p.sum())
    return out


def _sampled(rng, shares, routes, step):
    return {"step": step, "layers": [{"layer": j, "name": f"model.layers.{j}.mlp",
                                      "load": rng.multinomial(routes, shares[j]).tolist(), "tokens": routes // TOP_K}
                                     for j in range(len(shares))]}


@pytest.mark.parametrize("routes", [100_000, 4096, 512])
def test_a_healthy_run_never_breaches(routes):
    """Healthy shares sampled anew every interval, 150 intervals read with the default config in each phase: no
    layer is ever in breach (no false alarm)."""
    rng = np.random.default_rng(0)
    shares = _healthy(rng)
    cfg = AtlasConfig.from_dict({})
    for pretraining in (False, True):
        alarm = LoadAlarm(cfg.telemetry, cfg.policy)
        alarm.rebase(0)
        for i in range(150):
            reading = alarm.read(_sampled(rng, shares, routes, 50 * (i + 1)), pretraining)
            assert reading.breach == [], (i, reading.breach)
        assert not alarm.raised


def test_a_planted_collapse_breaches_at_once_and_raises_at_the_second_interval():
    rng = np.random.default_rng(1)
    healthy = _healthy(rng)
    collapsed = np.zeros(EXPERTS)
    collapsed[[5, 17]] = 0.5
    cfg = AtlasConfig.from_dict({})
    for pretraining in (False, True):
        alarm = LoadAlarm(cfg.telemetry, cfg.policy)
        alarm.rebase(0)
        for i in range(3):
            assert alarm.read(_sampled(rng, healthy, 100_000, 50 * (i + 1)), pretraining).breach == []
        planted = [healthy[0], collapsed, healthy[2], healthy[3]]
        first = alarm.read(_sampled(rng, planted, 100_000, 200), pretraining)
        assert [b["layer"] for b in first.breach] == [1] and not first.alerts and not first.early_gate
        expected = {"dead_floor", "effective"} | (set() if pretraining else {"new_dead", "share", "cv", "entropy"})
        assert kinds(first.breach[0]["reasons"]) == expected
        second = alarm.read(_sampled(rng, planted, 100_000, 250), pretraining)
        assert second.early_gate and second.standing and [a["key"] for a in second.alerts] == [ALARM_KEY]
        text = second.alerts[0]["text"]
        assert "model.layers.1.mlp (layer 1)" in text and "layers.0" not in text
        if not pretraining:  # newly dead: every expert but 5 and 17 whose reference share was 0.25 x uniform or more
            carried = [e for e in range(EXPERTS) if healthy[1][e] >= 0.25 / EXPERTS]
            assert len(carried) > 20 and second.breach[0]["experts"] == sorted(set(carried) | {5, 17})
            assert "experts 5, 17 take more than 4x the uniform share" in text
