"""The configuration tree: every key is validated."""

from __future__ import annotations

import pytest

from atlas_tracking import (
    AtlasConfig,
)
from atlas_tracking.schema.config import ConfigError


def test_bad_config_key():
    with pytest.raises(ValueError, match=r"unknown key 'receipts\.bootstraps'"):
        AtlasConfig.from_dict({"receipts": {"bootstraps": 5}})


TELEMETRY_ERRORS = [
    ({"enabled": "yes"}, r"'telemetry\.enabled' must be true/false"),
    ({"every_n_steps": 0}, r"'telemetry\.every_n_steps' must be >= 1 or null"),
    ({"every_n_steps": "50"}, r"'telemetry\.every_n_steps' must be an integer or null"),
    ({"picture_every": 0}, r"'telemetry\.picture_every' must be >= 1, got 0"),
    ({"top_experts": -1}, r"'telemetry\.top_experts' must be >= 0, got -1"),
    ({"consecutive": 0}, r"'telemetry\.consecutive' must be >= 1, got 0"),
    ({"consecutive": 1.5}, r"'telemetry\.consecutive' must be an integer"),
    ({"new_dead": 0}, r"'telemetry\.new_dead' must be >= 1, got 0"),
    ({"dead_min_expected": 0}, r"'telemetry\.dead_min_expected' must be > 0"),
    ({"dead_min_expected": float("nan")}, r"'telemetry\.dead_min_expected' must be > 0, got nan"),
    ({"dead_min_share": 1.5}, r"'telemetry\.dead_min_share' must be in \[0\.0, 1\.0\]"),
    ({"share_bound": 1}, r"'telemetry\.share_bound' must be > 1 \(a multiple of the uniform share\)"),
    ({"share_bound": float("nan")}, r"'telemetry\.share_bound' must be > 1 .*got nan"),
    ({"share_growth": 0.5}, r"'telemetry\.share_growth' must be >= 1"),
    ({"share_growth": float("nan")}, r"'telemetry\.share_growth' must be >= 1 .*got nan"),
    ({"cv_rise": -0.1}, r"'telemetry\.cv_rise' must be > 0"),
    ({"cv_rise": float("nan")}, r"'telemetry\.cv_rise' must be > 0, got nan"),
    ({"entropy_drop": 0}, r"'telemetry\.entropy_drop' must be in \(0\.0, 1\.0\]"),
    ({"entropy_drop": 1.5}, r"'telemetry\.entropy_drop' must be in \(0\.0, 1\.0\]"),
    ({"bogus": 1}, r"unknown key 'telemetry\.bogus'; allowed keys: enabled, every_n_steps"),
]


@pytest.mark.parametrize(("section", "message"), TELEMETRY_ERRORS, ids=[next(iter(s)) + "=" + repr(v)
                                                                        for s, _ in TELEMETRY_ERRORS
                                                                        for v in s.values()])
def test_bad_telemetry_values_are_named(section, message):
    with pytest.raises(ConfigError, match=message):
        AtlasConfig.from_dict({"telemetry": section})


def test_telemetry_section_from_yaml(tmp_path):
    path = tmp_path / "atlas.yaml"
    path.write_text("telemetry:\n  every_n_steps: 25\n  consecutive: 3\n  early_gate: false\n  share_bound: .inf\n")
    cfg = AtlasConfig.from_yaml(path).telemetry
    assert (cfg.every_n_steps, cfg.consecutive, cfg.early_gate, cfg.share_bound) == (25, 3, False, float("inf"))
    assert AtlasConfig.from_dict({}).telemetry.enabled and AtlasConfig.from_dict({}).telemetry.every_n_steps is None
    path.write_text("telemetry:\n  cv_rise: .nan\n")
    with pytest.raises(ConfigError, match=r"'telemetry\.cv_rise' must be > 0, got nan"):
        AtlasConfig.from_yaml(path)


@pytest.mark.parametrize("value", [0, -1.0, float("nan")])
def test_collective_timeout_must_be_positive(value):
    assert AtlasConfig.from_dict({}).gate.collective_timeout_s == 300.0  # well under gloo's own 30 minutes
    with pytest.raises(ConfigError, match=r"'gate\.collective_timeout_s' must be > 0, got"):
        AtlasConfig.from_dict({"gate": {"collective_timeout_s": value}})
