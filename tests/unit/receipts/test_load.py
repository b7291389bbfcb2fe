"""Training-batch load statistics (receipts/load.py) and the bounded interval summary (artifacts/load_summary.py)
against independent plain-Python loops written from their definitions, plus closed forms."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atlas_tracking.artifacts.load_summary import load_metrics, summarize, worst_row
from atlas_tracking.receipts.load import (
    layer_stats,
    load_cv,
    max_over_mean,
    normalised_entropy,
    ranked_experts,
)
from atlas_tracking.schema.load import SUMMARY_KEYS, ranked_keys

# --- the references: plain loops over the definitions ---------------------------------------------------------


def ref_cv(load):
    n = len(load)
    mean = sum(load) / n if n else 0.0
    if mean <= 0:
        return 0.0
    var = 0.0
    for x in load:
        var += (x - mean) ** 2
    return math.sqrt(var / n) / mean  # population variance: divide by E, not E - 1


def ref_max_over_mean(load):
    n = len(load)
    mean = sum(load) / n if n else 0.0
    if mean <= 0:
        return 0.0
    biggest = load[0]
    for x in load:
        biggest = max(biggest, x)
    return biggest / mean


def ref_entropy(load):
    total = sum(load)
    if total <= 0:
        return 0.0
    if len(load) == 1:
        return 1.0
    h = 0.0
    for x in load:
        if x > 0:
            p = x / total
            h -= p * math.log(p)
    return h / math.log(len(load))


def ref_dead(load):
    return [e for e in range(len(load)) if load[e] == 0]


def ref_ranked(load, count):
    """Selection by repeated scans: the largest (smallest) remaining load, the lower id on ties (strict compare)."""
    total = sum(load)

    def pick(better):
        left, out = list(range(len(load))), []
        while left and len(out) < count:
            best = left[0]
            for e in left[1:]:
                if better(load[e], load[best]):
                    best = e
            left.remove(best)
            out.append((best, round(load[best] / total, 4) if total else 0.0))
        return out

    return pick(lambda a, b: a > b), pick(lambda a, b: a < b)


def ref_summary(line):
    """The summary from its field docs (schema/load.py LoadSummary), layers without routes left out."""
    rows = [r for r in line["layers"] if sum(r["load"]) > 0]
    out = {"tokens": line.get("tokens", 0), "breach_layers": len(line.get("breach", [])),
           "alarm": int(bool(line.get("alarm")))}
    if not rows:
        return out
    worst = 0
    for i in range(len(rows)):
        if ref_cv(rows[i]["load"]) > ref_cv(rows[worst]["load"]):  # the first of equal CVs
            worst = i
    out["load_cv_max"] = ref_cv(rows[worst]["load"])
    out["worst_layer"] = rows[worst]["layer"]
    out["max_over_mean"] = max(ref_max_over_mean(r["load"]) for r in rows)
    out["dead_fraction_max"] = max(len(ref_dead(r["load"])) / len(r["load"]) for r in rows)
    out["entropy_min"] = min(ref_entropy(r["load"]) for r in rows)
    ep = [r["ep_tokens"] for r in rows if r.get("ep_tokens")]
    if ep:
        out["overload_factor"] = max(max(t) / (sum(t) / len(t)) if sum(t) else 0.0 for t in ep)
    drops = [r for r in rows if r.get("dropped") is not None]
    if drops:
        dropped = chosen = 0
        for r in drops:
            dropped += r["dropped"]
            chosen += sum(r["load"])
        out["dropped_fraction"] = dropped / chosen
    return out


# --- strategies ------------------------------------------------------------------------------------------------

loads = st.lists(st.integers(0, 10_000), min_size=1, max_size=48)
sparse = st.lists(st.sampled_from([0, 0, 1, 3, 3, 7, 1000]), min_size=1, max_size=16)  # ties and zeros


@st.composite
def lines(draw, ep: bool | None = None, drops: bool | None = None, experts: int | None = None):
    n_layers = draw(st.integers(1, 6))
    layers = []
    for i in range(n_layers):
        e = experts or draw(st.integers(1, 24))
        load = draw(st.lists(st.sampled_from([0, 0, 1, 2, 5, 5, 40, 300]), min_size=e, max_size=e))
        row = {"layer": 2 * i + draw(st.integers(0, 1)), "name": f"l{i}", "load": load, "tokens": sum(load) // 2}
        if drops if drops is not None else draw(st.booleans()):
            row["dropped"] = draw(st.integers(0, sum(load)))
        else:
            row["dropped"] = None
        if ep if ep is not None else draw(st.booleans()):
            row["ep_tokens"] = draw(st.lists(st.integers(0, 500), min_size=4, max_size=4))
        layers.append(row)
    line = {"step": 10, "tokens": max(r["tokens"] for r in layers), "layers": layers}
    if draw(st.booleans()):
        line["breach"] = [{"layer": 0}] * draw(st.integers(0, 3))
        line["alarm"] = draw(st.booleans())
    return line


# --- receipts/load.py ------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.one_of(loads, sparse))
def test_layer_stats_against_the_loops(load):
    s = layer_stats(load)
    assert s.cv == pytest.approx(ref_cv(load), rel=1e-9, abs=1e-12)
    assert load_cv(load) == s.cv
    assert s.max_over_mean == pytest.approx(ref_max_over_mean(load), rel=1e-12)
    assert max_over_mean(load) == s.max_over_mean
    assert s.entropy == pytest.approx(ref_entropy(load), rel=1e-9, abs=1e-12)
    assert normalised_entropy(load) == s.entropy
    assert 0.0 <= s.entropy <= 1.0 + 1e-12
    assert s.dead == ref_dead(load)
    assert s.dead_fraction == len(ref_dead(load)) / len(load)
    assert (s.routes, s.experts) == (sum(load), len(load))


@settings(max_examples=300, deadline=None)
@given(st.one_of(loads, sparse), st.integers(0, 20))
def test_ranked_experts_against_the_loop(load, count):
    assert ranked_experts(load, count) == ref_ranked(load, count)


@pytest.mark.parametrize("experts", [2, 3, 8, 32, 256])
def test_closed_forms(experts):
    even = layer_stats([17] * experts)
    assert even.cv == 0.0 and even.max_over_mean == 1.0 and even.dead == []
    assert even.entropy == pytest.approx(1.0, abs=1e-12)
    one = layer_stats([0] * (experts - 1) + [500])
    assert one.entropy == 0.0 and one.max_over_mean == pytest.approx(experts, rel=1e-12)
    assert one.cv == pytest.approx(math.sqrt(experts - 1), rel=1e-12)  # std sqrt(E-1) x mean
    assert one.dead == list(range(experts - 1)) and one.dead_fraction == (experts - 1) / experts
    # two of E experts take everything evenly: entropy ln 2 / ln E, max/mean E/2
    two = layer_stats([250, 250] + [0] * (experts - 2))
    assert two.entropy == pytest.approx(math.log(2) / math.log(experts), rel=1e-12)
    assert two.max_over_mean == pytest.approx(experts / 2, rel=1e-12)


def test_degenerate_layers():
    nothing = layer_stats([0, 0, 0])
    assert (nothing.cv, nothing.max_over_mean, nothing.entropy, nothing.dead) == (0.0, 0.0, 0.0, [0, 1, 2])
    single = layer_stats([9])
    assert (single.cv, single.max_over_mean, single.entropy, single.dead) == (0.0, 1.0, 1.0, [])
    assert ranked_experts([0, 0, 0], 2) == ([(0, 0.0), (1, 0.0)], [(0, 0.0), (1, 0.0)])
    assert ranked_experts([4, 4, 1, 1], 2) == ([(0, 0.4), (1, 0.4)], [(2, 0.1), (3, 0.1)])  # ties: the lower id


# --- artifacts/load_summary.py ---------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(lines())
def test_summarize_against_the_loop(line):
    got, ref = summarize(line), ref_summary(line)
    assert set(got) == set(ref)
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    if "worst_layer" in ref:
        assert worst_row(line)["layer"] == ref["worst_layer"]


@settings(max_examples=200, deadline=None)
@given(lines(), st.integers(0, 4))
def test_load_metrics_against_the_loop(line, top):
    metrics, ref = load_metrics(line, top), ref_summary(line)
    expected = {SUMMARY_KEYS[k]: float(v) for k, v in ref.items()}
    rows = [r for r in line["layers"] if sum(r["load"]) > 0]
    if rows and top:
        worst = next(r for r in rows if r["layer"] == ref["worst_layer"])
        busiest, idlest = ref_ranked(worst["load"], top)
        for end, ranked in (("top", busiest), ("bottom", idlest)):
            for i, (expert, share) in enumerate(ranked, start=1):
                expected[f"atlas/train/{end}{i}_expert"] = float(expert)
                expected[f"atlas/train/{end}{i}_share"] = share
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert all(isinstance(v, float) for v in metrics.values())


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(3, 64), st.booleans(), st.booleans())
def test_the_key_set_is_fixed_whatever_the_layers_and_experts(data, experts, ep, drops):
    """Whatever the depth (1-6 layers) and width (E >= top), one key set: the summary's fields and the worst layer's
    top/bottom ``top`` experts; no key names a layer or an expert."""
    top = 3
    line = data.draw(lines(ep=ep, drops=drops, experts=experts))
    line["layers"][0]["load"][0] += 1  # some layer saw routes
    keys = set(SUMMARY_KEYS.values()) - ({"atlas/train/overload_factor"} if not ep else set())
    keys -= {"atlas/train/dropped_fraction"} if not drops else set()
    assert set(load_metrics(line, top)) == keys | set(ranked_keys(top))
    assert len(load_metrics(line, top)) == len(keys) + 4 * top


def test_the_docstring_line_by_hand():
    """The module's example, worked by hand: layer 3 ([140, 40, 20, 0]) is the worst."""
    line = {"step": 50, "tokens": 100, "layers": [
        {"layer": 1, "name": "l1", "load": [50, 50, 50, 50], "dropped": None, "tokens": 100},
        {"layer": 3, "name": "l3", "load": [140, 40, 20, 0], "dropped": 10, "tokens": 100,
         "ep_tokens": [130, 60]}]}
    s = summarize(line)
    assert s["worst_layer"] == 3 and s["entropy_min"] == pytest.approx(ref_entropy([140, 40, 20, 0]))
    assert s["load_cv_max"] == pytest.approx(math.sqrt(((90 ** 2) + 10 ** 2 + 30 ** 2 + 50 ** 2) / 4) / 50)
    assert s["overload_factor"] == pytest.approx(130 / 95) and s["dropped_fraction"] == 10 / 200
    m = load_metrics(line, top=2)
    assert [m[f"atlas/train/top{i}_expert"] for i in (1, 2)] == [0.0, 1.0]
    assert [m[f"atlas/train/bottom{i}_share"] for i in (1, 2)] == [0.0, 0.1]
    empty = {"step": 5, "tokens": 0, "layers": [{"layer": 0, "name": "l0", "load": [0, 0], "tokens": 0}]}
    assert load_metrics(empty, 3) == {"atlas/train/tokens": 0.0, "atlas/train/breach_layers": 0.0,
                                      "atlas/train/alarm": 0.0}
