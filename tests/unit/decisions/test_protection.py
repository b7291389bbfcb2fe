"""``protected_layers: auto`` and ``atlas-tracking protect`` (docs/policy.md#protected-layers).

The selection rule against a plain-loop reference on synthetic per-layer evidence, its stability
(same input, any order, perturbations inside the margin), and on a real tiny Qwen3-MoE with 8 routed
layers whose experts are made mutually compatible, C2 damage planted in chosen layers (half of their
experts' output projections negated, or re-drawn at random) between the baseline and the next gates:
the planted layers are chosen through the real gate flow, the record names the set and its source, the
lifecycle margins use it, and the command line reads the run directory.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from atlas_tracking.artifacts.history import append_line, read_history
from atlas_tracking.cli import main
from atlas_tracking.decisions.protection import ProtectionError, choose, protect, resolve
from atlas_tracking.schema.config import AtlasConfig, ConfigError, LifecycleConfig

# --- the rule against a plain-loop reference --------------------------------------------------------------


def reference_choice(deltas: np.ndarray, alive: np.ndarray, floor: float) -> list[int]:
    """The rule in loops: mid band, median C2 loss and persistence, persistent first, worst loss, ordinal."""
    n_layers, n_gates = deltas.shape
    band = list(range(1, n_layers - 1)) if n_layers >= 3 else list(range(n_layers))
    k = min(max(1, math.ceil(n_layers / 2)), len(band))

    def median(xs: list[float]) -> float:
        s = sorted(xs)
        m = len(s) // 2
        return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2

    rows = []
    for layer in band:
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


@pytest.mark.parametrize("seed", range(12))
def test_choice_matches_plain_loop_reference(seed):
    rng = np.random.default_rng(seed)
    n_layers, n_gates = int(rng.integers(2, 12)), int(rng.integers(1, 6))
    deltas = rng.normal(-0.02, 0.03, (n_layers, n_gates))
    if seed % 3 == 0:
        deltas = np.round(deltas, 2)  # many ties: broken by persistence, then ordinal
    alive = rng.choice([0.25, 0.5, 0.75, 1.0], (n_layers, n_gates))
    out = choose(evidence_of(deltas, alive), persistence_floor=0.6)
    assert out["ordinals"] == reference_choice(deltas, alive, 0.6)
    ranks = sorted(r["rank"] for r in out["layers"] if r["candidate"])
    assert ranks == list(range(1, len(ranks) + 1))
    assert all(r["chosen"] == (r["ordinal"] in out["ordinals"]) for r in out["layers"])


def test_choice_is_stable_same_input_any_order_small_perturbation():
    rng = np.random.default_rng(7)
    deltas, alive = rng.normal(-0.03, 0.04, (10, 4)), np.ones((10, 4))
    ev = evidence_of(deltas, alive)
    first = choose(ev)
    assert choose(ev) == first
    shuffled = [ev[i] for i in rng.permutation(len(ev))]
    assert choose(shuffled)["ordinals"] == first["ordinals"]
    # every C2 delta moved by less than half the margin: the set in force stays, nothing is recorded
    nudged = evidence_of(deltas + rng.uniform(-0.0024, 0.0024, deltas.shape), alive)
    again = choose(nudged, previous=first["ordinals"], margin=0.005)
    assert again["ordinals"] == first["ordinals"] and again["changes"] == [] and again["kept_previous"]


def test_hysteresis_swaps_only_beyond_the_margin_and_says_why():
    losses = [0.0, 0.10, 0.08, 0.05, 0.040, 0.0, 0.0, 0.0]  # candidates 1..6, four chosen: 1 2 3 4
    alive = np.ones((8, 2))
    ev = evidence_of(-np.array([[x, x] for x in losses]), alive)
    assert choose(ev)["ordinals"] == [1, 2, 3, 4]
    inside = list(losses)
    inside[5] = 0.044  # layer 5 now outranks layer 4 (0.040), but by less than the margin
    kept = choose(evidence_of(-np.array([[x, x] for x in inside]), alive), previous=[1, 2, 3, 4], margin=0.005)
    assert kept["ordinals"] == [1, 2, 3, 4] and kept["changes"] == []
    assert choose(evidence_of(-np.array([[x, x] for x in inside]), alive))["ordinals"] == [1, 2, 3, 5]  # fresh
    beyond = list(losses)
    beyond[5] = 0.060
    swapped = choose(evidence_of(-np.array([[x, x] for x in beyond]), alive), previous=[1, 2, 3, 4], margin=0.005)
    assert swapped["ordinals"] == [1, 2, 3, 5]
    (change,) = swapped["changes"]
    assert (change["added"], change["removed"]) == (5, 4)
    assert "C2 loss +0.0600" in change["reason"] and "C2 loss +0.0400" in change["reason"]


def test_persistence_floor_ranks_collapsed_layers_last():
    losses = np.array([[0, 0.3, 0.2, 0.1, 0.05, 0.01, 0]]).T.repeat(3, axis=1)
    alive = np.ones_like(losses)
    alive[1] = 0.25  # the worst C2 loss, but most of its experts are dead: little specialization left
    out = choose(evidence_of(-losses, alive))
    assert out["ordinals"] == [2, 3, 4, 5]
    assert "below the floor" in out["layers"][1]["reason"] and not out["layers"][1]["chosen"]


def _rec(step, status, deltas, fp="f", active=8, extra=None):
    layers = [{"name": f"l{i}", "ordinal": i, "num_experts": 8, "experts_active": active,
               **({} if d is None else {"c2_delta": d})} for i, d in enumerate(deltas)]
    return {"step": step, "status": status, "canary_fingerprint": fp, "layers": layers, **(extra or {})}


def test_resolve_falls_back_to_mid_then_records_changes():
    lc = LifecycleConfig(protected_layers="auto")
    base = _rec(0, "BASELINE", [None] * 6)
    assert resolve([], 6, lc)["source"] == "mid (no evidence yet: 0 of 2 post-baseline gates)"
    one = [base, _rec(10, "GREEN", [0, -.1, 0, 0, -.2, 0])]
    early = resolve(one, 6, lc)
    assert early["ordinals"] == [1, 2, 3] and early["source"].startswith("mid (no evidence yet: 1 of 2")
    fields = {"protected_layers": early["ordinals"], "protected_source": early["source"]}
    two = [base, one[1], _rec(20, "GREEN", [0, -.1, 0, 0, -.2, 0], extra=fields)]  # gate 20 ran with mid
    chosen = resolve(two, 6, lc)
    assert chosen["source"] == "auto" and chosen["ordinals"] == [1, 2, 4]
    assert chosen["change"]["from"] == [1, 2, 3] and chosen["change"]["to"] == [1, 2, 4]
    # the next gate starts from the recorded set: same evidence, no change
    rec = {**two[2], "protected_layers": chosen["ordinals"], "protected_source": "auto"}
    assert resolve([*two[:2], rec], 6, lc)["change"] is None
    with pytest.raises(ProtectionError, match="mixes canaries"):
        resolve([base, _rec(10, "GREEN", [0] * 6, fp="g")], 6, lc)


def test_config_accepts_auto_and_checks_its_settings():
    cfg = AtlasConfig.from_dict({"lifecycle": {"protected_layers": "auto", "auto_min_gates": 3}})
    assert cfg.lifecycle.protected_layers == "auto" and cfg.lifecycle.auto_min_gates == 3
    with pytest.raises(ConfigError, match="auto_min_gates"):
        AtlasConfig.from_dict({"lifecycle": {"auto_min_gates": 0}})
    with pytest.raises(ConfigError, match="auto_persistence_floor"):
        AtlasConfig.from_dict({"lifecycle": {"auto_persistence_floor": 1.5}})
    with pytest.raises(ConfigError, match="protected_layers"):
        AtlasConfig.from_dict({"lifecycle": {"protected_layers": "middle"}})


# --- planted C2 damage on a real model, through the callback core ------------------------------------------

PLANTED_STRONG = (1, 6)
"""Half of the experts' output projections negated: co-active overlaps turn incompatible."""
PLANTED_MILD = (4,)
"""Half of the experts re-drawn at random: compatibility partly lost."""


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
    gates = ValidationGates(AtlasGate(model, canary, config, out_dir=out))
    records = [gates.start(step=0)]
    with torch.no_grad():
        for i in PLANTED_STRONG:
            model.model.layers[i].mlp.experts.down_proj[1::2].neg_()
        for i in PLANTED_MILD:
            w = model.model.layers[i].mlp.experts.down_proj
            w[1::2] = w.std() * torch.randn_like(w[1::2])
    for step in (10, 20, 30, 40):
        records.append(gates.run(step, 3.0))
    return out, records


def test_planted_damage_layers_are_chosen_and_recorded(planted_run):
    out, records = planted_run
    base, g10, g20, g30, g40 = records
    assert base["protected_source"] == g10["protected_source"] == "mid (no evidence yet: 0 of 2 post-baseline gates)"
    assert g20["protected_source"] == "mid (no evidence yet: 1 of 2 post-baseline gates)"
    assert g20["protected_layers"] == [2, 3, 4, 5]
    for rec in (g30, g40):
        assert rec["protected_source"] == "auto" and rec["protected_evidence_steps"][:2] == [10, 20]
        assert set(PLANTED_STRONG + PLANTED_MILD) <= set(rec["protected_layers"]) and len(rec["protected_layers"]) == 4
        assert [lay["ordinal"] for lay in rec["layers"] if lay["protected"]] == rec["protected_layers"]
    ranks = {r["ordinal"]: r["rank"] for r in g30["protection"]}
    assert {ranks[1], ranks[6]} == {1, 2} and ranks[4] == 3
    assert g30["protected_change"]["from"] == [2, 3, 4, 5]
    assert "protected_change" not in g40  # same evidence: the set in force stays, silently nothing changes
    # the record read back is the history, and the protect command gives the same set
    assert [r["protected_layers"] for r in read_history(out)] == [r["protected_layers"] for r in records]
    assert protect(out)["ordinals"] == g40["protected_layers"]


def handoff_reference(now: list[dict], ref: list[dict], protected: list[int], n_tokens: int) -> float:
    """Eq. 31 in a loop: min over protected layers of lam1 (c2 - c2_ref) + lam2 (pi_min / max(pi_ref, 1/T) - 1)."""
    worst = math.inf
    for i in protected:
        term = 1.0 * (now[i]["c2"] - ref[i]["c2"]) + 0.1 * (now[i]["pi_min"] / max(ref[i]["pi_min"], 1 / n_tokens) - 1)
        worst = min(worst, term)
    return worst


def test_lifecycle_margins_use_the_chosen_set(planted_run):
    records = planted_run[1]
    base, g30 = records[0], records[3]
    n_tokens = 8 * 32
    auto = handoff_reference(g30["layers"], base["layers"], g30["protected_layers"], n_tokens)
    mid = handoff_reference(g30["layers"], base["layers"], [2, 3, 4, 5], n_tokens)
    assert g30["handoff_margin"] == pytest.approx(auto, abs=1e-5)
    assert auto < mid - 0.1  # the strongly damaged layers lie outside "mid": the auto margin sees them
    assert records[2]["handoff_margin"] == pytest.approx(
        handoff_reference(records[2]["layers"], base["layers"], [2, 3, 4, 5], n_tokens), abs=1e-5)


def test_protect_cli_on_the_run_directory(planted_run, capsys):
    out, records = planted_run
    assert main(["protect", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"protected layers (auto): {records[-1]['protected_layers']} of 8 routed layers" in text
    assert "endpoint layer: not in the mid band" in text and "rank 1 of 6 candidates" in text
    assert main(["protect", str(out / "gates.jsonl"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ordinals"] == records[-1]["protected_layers"] and doc["source"] == "auto"
    assert doc["evidence_steps"] == [10, 20, 30, 40] and len(doc["layers"]) == 8


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
