"""``protected_layers: auto`` and ``atlas-tracking protect`` (docs/policy.md#protected-layers).

The selection rule against a plain-loop reference on synthetic per-layer evidence (the mid band at its
depth fraction, its rounding for 27 routed layers, too few layers), and the set's life in a run: mid until
evidence exists, chosen once (after the first post-baseline gates, or at the handoff from the pretraining
gates), then held whatever later evidence says; a change of the set is a recorded event. On a real tiny
Qwen3-MoE with 8 routed layers whose experts are made mutually compatible, C2 damage is planted (half of
their experts' output projections negated, or re-drawn at random) in an early layer outside the mid band
and in two band layers: the band layers are chosen through the real gate flow, the early one never is;
later damage on another band layer does not move the set, which survives a resume; an adopted list is
recorded as a change, and the command line proposes a set from the whole record.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from atlas_tracking.artifacts.history import append_line, read_history
from atlas_tracking.cli import main
from atlas_tracking.decisions.protection import (
    ProtectionError,
    candidates,
    choose,
    evidence,
    protect,
    record_fields,
    resolve,
    set_size,
)
from atlas_tracking.schema.config import AtlasConfig, ConfigError, LifecycleConfig

# --- the rule against a plain-loop reference --------------------------------------------------------------


def reference_band(n_layers: int, lo: float, hi: float) -> list[int]:
    """The mid band in exact arithmetic: depth i / (n - 1) in [lo, hi]; else the layers nearest its middle."""
    if n_layers == 1:
        return [0]
    lo_f, hi_f = Fraction(str(lo)), Fraction(str(hi))
    band = [i for i in range(n_layers) if lo_f <= Fraction(i, n_layers - 1) <= hi_f]
    if band:
        return band
    middle = (lo_f + hi_f) / 2
    best = None
    for i in range(n_layers):
        d = abs(Fraction(i, n_layers - 1) - middle)
        if best is None or d < best:
            best, band = d, [i]
        elif d == best:
            band.append(i)
    return band


def reference_choice(deltas: np.ndarray, alive: np.ndarray, floor: float, band=(0.25, 0.75)) -> list[int]:
    """The rule in loops: mid band, median C2 loss and persistence, persistent first, worst loss, ordinal;
    half the band, rounded up."""
    n_layers, n_gates = deltas.shape
    pool = reference_band(n_layers, *band)
    k = (len(pool) + 1) // 2

    def median(xs: list[float]) -> float:
        s = sorted(xs)
        m = len(s) // 2
        return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2

    rows = []
    for layer in pool:
        loss = median([-float(deltas[layer, g]) for g in range(n_gates)])
        persistence = median([float(alive[layer, g]) for g in range(n_gates)])
        rows.append((persistence >= floor, loss, persistence, layer))
    chosen = []
    for _ in range(k):  # selection: repeatedly take the best remaining row
        best = None
        for row in rows:
            if row[3] in chosen:
                continue
            if best is None or (row[0], row[1], row[2], -row[3]) > (best[0], best[1], best[2], -best[3]):
                best = row
        chosen.append(best[3])
    return sorted(chosen)


def evidence_of(deltas: np.ndarray, alive: np.ndarray) -> list[dict]:
    return [{"ordinal": i, "name": f"model.layers.{i}.mlp", "c2_deltas": deltas[i].tolist(),
             "alive": alive[i].tolist()} for i in range(len(deltas))]


@pytest.mark.parametrize("seed", range(16))
def test_choice_matches_plain_loop_reference(seed):
    rng = np.random.default_rng(seed)
    n_layers, n_gates = int(rng.integers(1, 30)), int(rng.integers(1, 6))
    deltas = rng.normal(-0.02, 0.03, (n_layers, n_gates))
    if seed % 3 == 0:
        deltas = np.round(deltas, 2)  # many ties: broken by persistence, then ordinal
    alive = rng.choice([0.25, 0.5, 0.75, 1.0], (n_layers, n_gates))
    band = (0.25, 0.75) if seed % 2 else tuple(sorted(np.round(rng.uniform(0, 1, 2), 2)))
    out = choose(evidence_of(deltas, alive), band=band, persistence_floor=0.6)
    assert out["ordinals"] == reference_choice(deltas, alive, 0.6, band)
    assert out["candidates"] == reference_band(n_layers, *band)
    ranks = sorted(r["rank"] for r in out["layers"] if r["candidate"])
    assert ranks == list(range(1, len(ranks) + 1))
    assert all(r["chosen"] == (r["ordinal"] in out["ordinals"]) for r in out["layers"])


def test_choice_is_the_same_for_the_same_input_in_any_order():
    rng = np.random.default_rng(7)
    deltas, alive = rng.normal(-0.03, 0.04, (10, 4)), np.ones((10, 4))
    ev = evidence_of(deltas, alive)
    first = choose(ev)
    assert choose(ev) == first
    shuffled = [ev[i] for i in rng.permutation(len(ev))]
    assert choose(shuffled)["ordinals"] == first["ordinals"]


def test_band_rounding_for_27_routed_layers_and_other_depths():
    # 27 routed layers: depths are multiples of 1/26; 0.25 x 26 = 6.5 rounds up to 7, 0.75 x 26 = 19.5 down to 19
    assert candidates(27) == list(range(7, 20)) and set_size(27) == 7
    assert candidates(8) == [2, 3, 4, 5] and set_size(8) == 2
    for band in [(0.25, 0.75), (0.3, 0.7), (0.1, 0.9), (0.2, 0.6), (0.0, 1.0), (0.5, 0.5 + 1e-3)]:
        for n in range(1, 41):
            assert candidates(n, band) == reference_band(n, *band), (band, n)
    # a band edge that lands on a layer up to float rounding (0.3 x 10 = 3.0000000000000004) includes it
    assert candidates(11, (0.3, 0.7)) == [3, 4, 5, 6, 7]
    cfg = AtlasConfig.from_dict({"lifecycle": {"protected_layers": "auto", "auto_band": [0.3, 0.7]}})
    assert candidates(27, cfg.lifecycle.auto_band) == list(range(8, 19))  # ceil(7.8) to floor(18.2)


def test_too_few_routed_layers_for_the_band_take_the_layers_nearest_its_middle():
    assert candidates(1) == [0] and candidates(2) == [0, 1] and candidates(3) == [1] and candidates(4) == [1, 2]
    assert candidates(8, (0.5, 0.55)) == [4]  # no depth 0.5..0.55 among multiples of 1/7: 4/7 is nearest 0.525
    out = choose(evidence_of(np.array([[-0.01], [-0.2]]), np.ones((2, 1))))
    assert out["ordinals"] == [1] and [r["candidate"] for r in out["layers"]] == [True, True]


def test_early_and_late_layer_damage_never_enters_the_set():
    ones = np.ones((8, 2))
    losses = np.array([0.9, 0.8, 0.0, 0.05, 0.01, 0.0, 0.7, 0.6])
    out = choose(evidence_of(-np.stack([losses, losses], axis=1), ones))
    assert out["ordinals"] == [3, 4]
    assert all(out["layers"][i]["reason"] == "outside the mid band [0.25, 0.75]: not a candidate" for i in (0, 1, 6, 7))
    # 27 routed layers: heavy damage on every early and late layer, mild damage inside the band
    rng = np.random.default_rng(3)
    losses = np.where((np.arange(27) < 7) | (np.arange(27) > 19), 1.0, rng.uniform(0, 0.1, 27))
    deltas = -np.stack([losses, losses, losses], axis=1)
    out = choose(evidence_of(deltas, np.ones((27, 3))))
    assert len(out["ordinals"]) == 7 and set(out["ordinals"]) <= set(range(7, 20))
    assert out["ordinals"] == reference_choice(deltas, np.ones((27, 3)), 0.5)


def test_persistence_floor_ranks_collapsed_layers_last():
    losses = np.array([[0, 0.5, 0.3, 0.2, 0.1, 0.05, 0]]).T.repeat(3, axis=1)  # 7 layers: band 2, 3, 4
    alive = np.ones_like(losses)
    alive[2] = 0.25  # the worst C2 loss in the band, but most of its experts are dead: little specialization left
    out = choose(evidence_of(-losses, alive))
    assert out["ordinals"] == [3, 4]
    assert "below the floor" in out["layers"][2]["reason"] and not out["layers"][2]["chosen"]


# --- the set's life in a run: chosen once, held, changes recorded -------------------------------------------


def _rec(step, status, deltas, fp="f", active=8, extra=None, phase="post_training"):
    layers = [{"name": f"l{i}", "ordinal": i, "num_experts": 8, "experts_active": active,
               **({} if d is None else {"c2_delta": d})} for i, d in enumerate(deltas)]
    return {"step": step, "status": status, "phase": phase, "canary_fingerprint": fp, "layers": layers,
            **(extra or {})}


def gate_flow(records: list[dict], gates: list[tuple], lc: LifecycleConfig, fp: str = "f") -> list[dict]:
    """Gates after ``records`` as a run writes them: each gate's set resolved from the history before it,
    written to its record (and its layers' ``protected`` flags). ``gates``: (step, status, deltas, phase)."""
    out = list(records)
    for step, status, deltas, phase in gates:
        res = resolve(out, len(deltas), lc, step=step, pretraining=phase == "pretraining", fingerprint=fp)
        rec = _rec(step, status, deltas, fp=fp, phase=phase, extra=record_fields(res))
        for lay in rec["layers"]:
            lay["protected"] = lay["ordinal"] in res["ordinals"]
        out.append(rec)
    return out


AUTO = LifecycleConfig(protected_layers="auto")
EARLY = [0, 0, 0, -0.2, -0.1, 0, 0, 0]  # damage on band layers 3 and 4
LATER = [0, 0, -0.5, 0, 0, -0.4, 0, 0]  # later, worse damage on band layers 2 and 5


def test_set_is_chosen_once_then_held_when_later_evidence_ranks_other_layers_worse():
    gates = [(0, "BASELINE", [None] * 8, "post_training"), (10, "GREEN", EARLY, "post_training"),
             (20, "GREEN", EARLY, "post_training")] + [(s, "YELLOW", LATER, "post_training") for s in range(30, 90, 10)]
    recs = gate_flow([], gates, AUTO)
    assert [r["protected_source"] for r in recs[:3]] == ["mid (no evidence yet: 0 of 2 post-baseline gates)"] * 2 + [
        "mid (no evidence yet: 1 of 2 post-baseline gates)"]
    assert all(r["protected_layers"] == [2, 3, 4, 5] for r in recs[:3])
    chosen = recs[3]
    assert chosen["protected_source"] == "auto (chosen at step 30 from gates [10, 20])"
    assert chosen["protected_layers"] == [3, 4] and chosen["protected_evidence_steps"] == [10, 20]
    assert {k: chosen["protected_change"][k] for k in ("from", "to", "step")} == {
        "from": [2, 3, 4, 5], "to": [3, 4], "step": 30}
    assert [r["rank"] for r in chosen["protection"]] == [None, None, 3, 1, 2, 4, None, None]
    for rec in recs[4:]:  # held: the same set and source, no change, no new per-layer ranking
        assert rec["protected_layers"] == [3, 4] and rec["protected_source"] == chosen["protected_source"]
        assert "protected_change" not in rec and "protection" not in rec
    # the whole record now ranks layers 2 and 5 worst: a proposal, never a silent move inside the run
    assert choose(evidence(recs)[0])["ordinals"] == [2, 5]


def test_handoff_chooses_once_from_the_pretraining_gates():
    pre = [(0, "BASELINE", [None] * 8, "pretraining")] + [(s, "GREEN", EARLY, "pretraining") for s in (10, 20, 30)]
    recs = gate_flow([], pre, AUTO)
    assert all(r["protected_source"] == "mid (no evidence yet: pretraining; the set is chosen at the handoff from "
               "the pretraining gates)" for r in recs)
    post = [(40, "BASELINE", [None] * 8, "post_training")] + [(s, "YELLOW", LATER, "post_training") for s in (50, 60, 70)]
    recs = gate_flow(recs, post, AUTO)
    handoff = recs[4]
    assert handoff["protected_source"] == "auto (chosen at step 40 from the pretraining gates [10, 20, 30], at the handoff)"
    assert handoff["protected_layers"] == [3, 4] and handoff["protected_change"]["step"] == 40
    assert all(r["protected_layers"] == [3, 4] and "protected_change" not in r for r in recs[5:])
    # one pretraining gate is not enough evidence: the choice waits for two post-baseline gates after the handoff
    short = gate_flow([], pre[:2] + post, AUTO)
    assert short[2]["protected_source"] == "mid (no evidence yet: 1 of 2 pretraining gates at the handoff)"
    assert short[3]["protected_source"] == "mid (no evidence yet: 0 of 2 post-baseline gates)"
    assert short[5]["protected_source"] == "auto (chosen at step 70 from gates [50, 60])"
    assert short[5]["protected_layers"] == [2, 5]


def test_a_change_of_the_set_is_an_event_in_the_record():
    gates = [(0, "BASELINE", [None] * 8, "post_training")] + [(s, "GREEN", EARLY, "post_training") for s in (10, 20, 30)]
    recs = gate_flow([], gates, AUTO)
    adopted = LifecycleConfig(protected_layers=[2, 5])  # the user adopts a list (a resume with another config)
    recs = gate_flow(recs, [(40, "GREEN", EARLY, "post_training"), (50, "GREEN", EARLY, "post_training")], adopted)
    change = recs[4]["protected_change"]
    assert {k: change[k] for k in ("from", "to", "step")} == {"from": [3, 4], "to": [2, 5], "step": 40}
    assert change["reason"] == ("config: lifecycle.protected_layers: [2, 5], after auto (chosen at step 30 from "
                                "gates [10, 20])")
    assert recs[4]["protected_source"] == "config: lifecycle.protected_layers: [2, 5]"
    assert record_fields(resolve(recs, 8, adopted, step=60)) == {}  # the same set again: nothing to record
    back = gate_flow(recs, [(60, "GREEN", EARLY, "post_training")], AUTO)[-1]  # auto again: the run's choice
    assert back["protected_layers"] == [3, 4] and back["protected_change"]["from"] == [2, 5]
    assert back["protected_change"]["reason"].endswith("after the set of the gate at step 50")
    everything = resolve(recs, 8, LifecycleConfig(protected_layers="all"), step=60)
    assert everything["change"]["to"] == list(range(8))


def test_resolve_falls_back_to_mid_and_refuses_mixed_canaries():
    base = _rec(0, "BASELINE", [None] * 6)
    assert resolve([], 6, AUTO, step=0)["source"] == "mid (no evidence yet: 0 of 2 post-baseline gates)"
    assert resolve([base], 6, AUTO, step=10)["ordinals"] == [1, 2, 3]
    mixed = [base, _rec(10, "GREEN", [0] * 6), _rec(20, "GREEN", [0] * 6, fp="g")]
    with pytest.raises(ProtectionError, match="mixes canaries"):
        resolve(mixed, 6, AUTO, step=30)
    # a gate reads the evidence of its own canary only
    assert resolve(mixed, 6, AUTO, step=30, fingerprint="g")["source"].startswith("mid (no evidence yet: 1 of 2")


def test_config_accepts_auto_and_checks_its_settings():
    cfg = AtlasConfig.from_dict({"lifecycle": {"protected_layers": "auto", "auto_min_gates": 3}})
    assert cfg.lifecycle.protected_layers == "auto" and cfg.lifecycle.auto_min_gates == 3
    assert cfg.lifecycle.auto_band == [0.25, 0.75]
    with pytest.raises(ConfigError, match="auto_min_gates"):
        AtlasConfig.from_dict({"lifecycle": {"auto_min_gates": 0}})
    with pytest.raises(ConfigError, match="auto_persistence_floor"):
        AtlasConfig.from_dict({"lifecycle": {"auto_persistence_floor": 1.5}})
    with pytest.raises(ConfigError, match="protected_layers"):
        AtlasConfig.from_dict({"lifecycle": {"protected_layers": "middle"}})
    for bad in ([0.75, 0.25], [0.5, 0.5], [-0.1, 0.5], [0.2, 1.5], [0.25], [0.1, 0.5, 0.9], "mid"):
        with pytest.raises(ConfigError, match=r"'lifecycle\.auto_band'"):
            AtlasConfig.from_dict({"lifecycle": {"auto_band": bad}})
    with pytest.raises(ConfigError, match=r"unknown key 'lifecycle\.auto_margin'"):  # no hysteresis: the set is held
        AtlasConfig.from_dict({"lifecycle": {"auto_margin": 0.005}})


# --- planted C2 damage on a real model, through the callback core ------------------------------------------

PLANTED_EARLY = (1,)
"""Outside the mid band (ordinals 2-5 of 8): half of the experts' output projections negated."""
PLANTED_STRONG = (5,)
"""Half of the experts' output projections negated: co-active overlaps turn incompatible."""
PLANTED_MILD = (3,)
"""Half of the experts re-drawn at random: compatibility partly lost."""
PLANTED_LATER = (2,)
"""After the choice, half of the output projections negated: later evidence ranks it worst."""
ADOPTED = [2, 5]


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from atlas_tracking import Canary
    from atlas_tracking.callbacks import ValidationGates
    from atlas_tracking.gate import AtlasGate

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2))
    with torch.no_grad():  # experts close to one another: compatible co-active overlaps (C2 near 1)
        for layer in model.model.layers:
            for w in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                w.copy_(w[:1].expand_as(w) + 0.1 * w.std() * torch.randn_like(w))
    canary = Canary.from_token_ids(np.random.default_rng(0).integers(0, 64, 4000), window=32, n_windows=8, seed=0)
    out = tmp_path_factory.mktemp("planted") / "atlas"
    config = {"receipts": {"progress": False, "n_bootstrap": 200}, "policy": {"phase": "post_training"},
              "lifecycle": {"protected_layers": "auto"}}

    def negate(layers):
        with torch.no_grad():
            for i in layers:
                model.model.layers[i].mlp.experts.down_proj[1::2].neg_()

    def segment(lifecycle, state, start, steps):
        """One training segment: a fresh gate, resumed from ``state`` at ``start`` (or the step-0 baseline)."""
        gates = ValidationGates(AtlasGate(model, canary, {**config, "lifecycle": lifecycle}, out_dir=out))
        gates.load_state_dict(state)
        first = gates.start(step=start)
        recs = [first] if first is not None else []
        return gates, recs + [gates.run(step, 3.0) for step in steps]

    gates, records = segment({"protected_layers": "auto"}, None, 0, [])
    negate(PLANTED_EARLY + PLANTED_STRONG)
    with torch.no_grad():
        for i in PLANTED_MILD:
            w = model.model.layers[i].mlp.experts.down_proj
            w[1::2] = w.std() * torch.randn_like(w[1::2])
    records += [gates.run(step, 3.0) for step in (10, 20, 30)]
    negate(PLANTED_LATER)
    records += [gates.run(step, 3.0) for step in (40, 50)]
    gates, more = segment({"protected_layers": "auto"}, gates.state_dict(), 50, [60, 70])  # a resume
    records += more
    gates, more = segment({"protected_layers": ADOPTED}, gates.state_dict(), 70, [80, 90])  # adopts a list
    return out, records + more


def test_planted_damage_in_the_band_is_chosen_once_and_held(planted_run):
    records = planted_run[1]
    base, g10, g20, g30, g40, g50 = records[:6]
    assert base["protected_source"] == g10["protected_source"] == "mid (no evidence yet: 0 of 2 post-baseline gates)"
    assert g20["protected_source"] == "mid (no evidence yet: 1 of 2 post-baseline gates)"
    assert g20["protected_layers"] == [2, 3, 4, 5]
    # the new rule protects half of the mid band (2 of ordinals 2-5), so the planted band layers alone
    assert g30["protected_source"] == "auto (chosen at step 30 from gates [10, 20])"
    assert g30["protected_layers"] == sorted(PLANTED_STRONG + PLANTED_MILD) and g30["protected_evidence_steps"] == [10, 20]
    assert g30["protected_change"] == {"from": [2, 3, 4, 5], "to": [3, 5], "step": 30, "reason": (
        "auto (chosen at step 30 from gates [10, 20]), after mid (no evidence yet: 1 of 2 post-baseline gates)")}
    rows = {r["ordinal"]: r for r in g30["protection"]}
    assert rows[5]["rank"] == 1 and rows[3]["rank"] == 2
    # the early layer's damage is the largest of all, yet it is not a candidate
    assert rows[1]["c2_loss"] > rows[3]["c2_loss"] and rows[1]["rank"] is None and not rows[1]["chosen"]
    assert rows[1]["reason"] == "outside the mid band [0.25, 0.75]: not a candidate"
    for rec in (g40, g50):  # later damage on layer 2: its own evidence would choose it, the set stays
        assert rec["protected_layers"] == [3, 5] and rec["protected_source"] == g30["protected_source"]
        assert "protected_change" not in rec and "protection" not in rec
        assert [lay["ordinal"] for lay in rec["layers"] if lay["protected"]] == [3, 5]
    assert 2 in choose(evidence([g40, g50])[0])["ordinals"]


def test_the_choice_survives_a_resume(planted_run):
    out, records = planted_run
    g60, g70 = records[6:8]
    assert g60["resume"] and g60["status"] == "BASELINE" and g60["branch"] != records[5]["branch"]
    for rec in (g60, g70):  # read back from the run's record by the resumed gate
        assert rec["protected_layers"] == [3, 5] and rec["protected_source"] == records[3]["protected_source"]
        assert "protected_change" not in rec
    assert [r["protected_layers"] for r in read_history(out)[:8]] == [r["protected_layers"] for r in records[:8]]


def test_an_adopted_list_is_recorded_as_a_change(planted_run):
    records = planted_run[1]
    g80, g90 = records[8:]
    assert g80["protected_change"] == {"from": [3, 5], "to": ADOPTED, "step": 80, "reason": (
        f"config: lifecycle.protected_layers: {ADOPTED}, after {records[3]['protected_source']}")}
    assert g80["protected_layers"] == ADOPTED and g80["protected_source"] == f"config: lifecycle.protected_layers: {ADOPTED}"
    assert [lay["ordinal"] for lay in g90["layers"] if lay["protected"]] == ADOPTED
    assert not {"protected_change", "protected_source", "protected_layers"} & set(g90)  # no change: nothing added


def handoff_reference(now: list[dict], ref: list[dict], protected: list[int], n_tokens: int) -> float:
    """Eq. 31 in a loop: min over protected layers of lam1 (c2 - c2_ref) + lam2 (rho - 1),
    rho = (pi_min + 1/T) / (pi_min_ref + 1/T)."""
    worst = math.inf
    for i in protected:
        rho = (now[i]["pi_min"] + 1 / n_tokens) / (ref[i]["pi_min"] + 1 / n_tokens)
        term = 1.0 * (now[i]["c2"] - ref[i]["c2"]) + 0.1 * (rho - 1)
        worst = min(worst, term)
    return worst


def test_lifecycle_margins_use_the_chosen_set(planted_run):
    records = planted_run[1]
    base, g30 = records[0], records[3]
    n_tokens = 8 * 32
    auto = handoff_reference(g30["layers"], base["layers"], g30["protected_layers"], n_tokens)
    assert g30["handoff_margin"] == pytest.approx(auto, abs=1e-5)
    # the damaged band layers bind the margin; the band's undamaged layers alone would read far safer
    assert auto < handoff_reference(g30["layers"], base["layers"], [2, 4], n_tokens) - 0.1
    assert records[2]["handoff_margin"] == pytest.approx(
        handoff_reference(records[2]["layers"], base["layers"], [2, 3, 4, 5], n_tokens), abs=1e-5)


def test_protect_cli_proposes_from_the_whole_record(planted_run, capsys):
    out = planted_run[0]
    assert main(["protect", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["evidence_steps"] == [10, 20, 30, 40, 50, 70, 90] and len(doc["layers"]) == 8
    assert doc["candidates"] == [2, 3, 4, 5] and doc["size"] == 2 and doc["band"] == [0.25, 0.75]
    assert doc["in_force"] == {"step": 90, "ordinals": ADOPTED,
                              "source": f"config: lifecycle.protected_layers: {ADOPTED} (recorded at step 80)"}
    assert doc["ordinals"] == [3, 5]  # the planted layers: damaged against the baseline in most gates
    assert doc["adopt"] == "lifecycle.protected_layers: [3, 5]"
    assert protect(out)["ordinals"] == doc["ordinals"]
    assert main(["protect", str(out / "gates.jsonl")]) == 0
    text = capsys.readouterr().out
    assert "proposed protected layers: [3, 5] of 8 routed layers" in text
    assert "in force at step 90: [2, 5] (config: lifecycle.protected_layers: [2, 5] (recorded at step 80))" in text
    assert "to adopt it, set in the run's atlas config: lifecycle.protected_layers: [3, 5]" in text
    assert "outside the mid band [0.25, 0.75]: not a candidate" in text and "rank 1 of 4 candidates" in text


def test_protect_cli_bad_input_exits_2(tmp_path, capsys):
    assert main(["protect", str(tmp_path / "nowhere")]) == 2
    assert "no such gates file or run directory" in capsys.readouterr().err
    only_base = tmp_path / "base"
    only_base.mkdir()
    append_line(only_base / "gates.jsonl", _rec(0, "BASELINE", [None] * 4))
    append_line(only_base / "gates.jsonl", _rec(10, "GREEN", [0.0] * 4))
    assert main(["protect", str(only_base)]) == 2
    assert "1 post-baseline gate(s)" in capsys.readouterr().err
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for rec in (_rec(0, "BASELINE", [None] * 4), _rec(10, "GREEN", [0.0] * 4), _rec(20, "GREEN", [0.0] * 4, fp="g")):
        append_line(mixed / "gates.jsonl", rec)
    assert main(["protect", str(mixed)]) == 2
    assert "mixes canaries" in capsys.readouterr().err
