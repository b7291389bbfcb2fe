"""Alert rules from YAML, alert-state round trips, and the replay command's input checks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atlas_tracking.cli import main
from atlas_tracking.decisions.alerts import AlertEngine
from atlas_tracking.decisions.replay import replay
from atlas_tracking.schema.config import AtlasConfig, ConfigError

YAML = """
policy:
  c2_tol: 0.002
alerts:
  on_revoked: ERROR
  rules:
    - metric: dead_experts
      op: ">"
      value: 64
      scope: any_protected_layer
      level: WARN
      min_interval_steps: 1000
"""


def _gate(step, dead, protected=True):
    return {"step": step, "c2": 0.1, "dead_experts": 1.0, "min_entropy": 3.0, "mean_cv": 50.0, "loss": 2.0,
            "layers": [{"name": "model.layers.3.mlp", "ordinal": 1, "protected": protected, "dead_experts": dead}]}


def test_yaml_rules_fire_with_level_and_interval(tmp_path):
    path = tmp_path / "atlas.yaml"
    path.write_text(YAML)
    cfg = AtlasConfig.from_yaml(path)
    assert cfg.policy.c2_tol == 0.002 and cfg.alerts.rules[0].name == "dead_experts > 64 (any_protected_layer)"
    out = replay([_gate(0, 70), _gate(500, 70), _gate(1000, 70), _gate(1500, 10), _gate(2500, 80)], cfg)
    fired = [(o["step"], [a["level"] for a in o["alerts"] if a["key"].startswith("rule:")]) for o in out]
    assert fired == [(0, ["WARN"]), (500, []), (1000, ["WARN"]), (1500, []), (2500, ["WARN"])]
    assert "model.layers.3.mlp=70" in out[0]["alerts"][0]["text"]


def test_unprotected_layers_do_not_fire_protected_rules(tmp_path):
    path = tmp_path / "atlas.yaml"
    path.write_text(YAML)
    out = replay([_gate(0, 70, protected=False)], AtlasConfig.from_yaml(path))
    assert out[0]["alerts"] == []


@pytest.mark.parametrize(
    "text,needle",
    [
        ("policy:\n  c2_toll: 0.1\n", "unknown key 'policy.c2_toll'"),
        ("policy:\n  n_recover: two\n", "'policy.n_recover' must be an integer"),
        ("alerts:\n  rules:\n    - metric: c2\n      op: '!='\n", "'alerts.rules[0].op' must be one of"),
        ("alerts:\n  on_revoked: LOUD\n", "'alerts.on_revoked' must be one of 'INFO', 'WARN', 'ERROR', 'off'"),
        ("- just\n- a list\n", "must hold a mapping"),
    ],
)
def test_bad_yaml_names_the_key(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=None) as info:
        AtlasConfig.from_yaml(path)
    assert needle in str(info.value)


def test_yaml_is_read_with_safe_load(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("policy: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        AtlasConfig.from_yaml(path)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["revoked", "alert", "prepare", "intervene", "clean", "recovering"]),
                          st.integers(0, 200)), min_size=2, max_size=10), st.data())
def test_alert_state_roundtrip(stages, data):
    cfg = AtlasConfig.from_dict({"alerts": {"rules": [{"metric": "dead_experts", "value": 100, "scope": "any_layer",
                                                      "min_interval_steps": 300}]}})
    decisions = [({"step": i * 100, "stage": s, "status": "YELLOW"}, _gate(i * 100, dead)) for i, (s, dead) in enumerate(stages)]
    cut = data.draw(st.integers(1, len(decisions) - 1))
    a = AlertEngine(cfg.alerts, cfg.lifecycle)
    straight = [[e.to_dict() for e in a.evaluate(d, r)] for d, r in decisions]
    b = AlertEngine(cfg.alerts, cfg.lifecycle)
    for d, r in decisions[:cut]:
        b.evaluate(d, r)
    c = AlertEngine(cfg.alerts, cfg.lifecycle)
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))
    assert [[e.to_dict() for e in c.evaluate(d, r)] for d, r in decisions[cut:]] == straight[cut:]


def test_alert_titles_fit_wandb_limit():
    engine = AlertEngine(AtlasConfig.from_dict({"alerts": {"rules": [{"metric": "x" * 80, "value": 0}]}}).alerts)
    events = engine.evaluate({"step": 1, "stage": "revoked", "status": "YELLOW"}, {"step": 1, "x" * 80: 5})
    assert all(len(e.title) < 64 for e in events) and len(events) == 2


@pytest.mark.parametrize(
    "lines,needle",
    [
        (['{"step": 0, "c2": 0.1, "dead_experts": 1, "min_entropy": 3, "mean_cv": 50, "loss": 1}', "{not json"],
         "gates.jsonl:2: not valid JSON"),
        (['{"step": 0, "c2": 0.1, "dead_experts": 1, "min_entropy": 3, "mean_cv": 50, "loss": 1}',
          '{"step": 5, "c2": 0.1, "min_entropy": 3, "mean_cv": 50, "loss": 1}'], "gates.jsonl:2: field 'dead_experts' is missing"),
        (['{"step": 0, "c2": "high", "dead_experts": 1, "min_entropy": 3, "mean_cv": 50, "loss": 1}'],
         "gates.jsonl:1: field 'c2' must be a finite number"),
    ],
)
def test_replay_bad_lines_name_line_and_field_and_print_nothing(tmp_path, capsys, lines, needle):
    path = tmp_path / "gates.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and needle in captured.err


def test_replay_cli_with_config_and_out(tmp_path, capsys):
    path = tmp_path / "gates.jsonl"
    path.write_text("\n".join(json.dumps(_gate(s, 70)) for s in (0, 1000)) + "\n")
    cfg = tmp_path / "atlas.yaml"
    cfg.write_text(YAML)
    out = tmp_path / "decisions.jsonl"
    assert main(["replay", str(path), "--config", str(cfg), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["status"] for r in rows] == ["BASELINE", "GREEN"]
    assert set(rows[0]) >= {"step", "status", "stage", "action", "interpretation", "licensed", "unlicensed",
                            "intervention", "alerts"}


def test_occupancy_alerts_name_dead_and_overloaded_experts_as_a_bounded_list():
    """Every channel gets the event's text: it names the experts per layer, the first three and a count."""
    cfg = AtlasConfig.from_dict({"alerts": {"rules": [{"metric": "dead_experts", "op": ">", "value": 4,
                                                       "scope": "any_layer"}]}})
    load = [0 if e in (3, 7, 12, 20, 21, 22, 23, 40) else 10 for e in range(48)]
    load[5] = 200
    record = {"step": 30, "layers": [{"name": "model.layers.2.mlp", "index": 2, "dead_experts": 8,
                                      "expert_load": load},
                                     {"name": "model.layers.3.mlp", "index": 3, "dead_experts": 0,
                                      "expert_load": [10] * 48}]}
    engine = AlertEngine(cfg.alerts, cfg.lifecycle)
    engine.load_state_dict({"last_stage": "prepare"})
    events = {e.key: e for e in engine.evaluate({"step": 30, "stage": "intervene", "status": "RED"}, record)}
    named = "Experts: layer 2: experts 3, 7, 12 (+5 more) dead; expert 5 overloaded."
    assert events["stage:intervene"].text.endswith(named) and events["stage:intervene"].level == "ERROR"
    assert events["rule:" + cfg.alerts.rules[0].name].text.endswith(named)
    assert "layer 3" not in events["stage:intervene"].text  # a layer with nothing to name is left out
