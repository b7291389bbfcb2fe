"""The docs' hand-written MoE recipe runs as written, and the discovery error points to it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from torch import nn

from atlas_tracking.adapters import NoRoutedLayersError, find_routed_layers
from atlas_tracking.artifacts.gate_report import read_artifact, verify

EXTENDING = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def recipe_code() -> str:
    text = EXTENDING.read_text()
    section = text[text.index("## Your own MoE module"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_readme_recipe_registers_a_hand_written_moe_and_trains_with_gates(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = recipe_code()
    assert len(code[code.index("class TinyMoELayer"):code.index("# --- train")].strip().splitlines()) <= 25
    scope: dict = {"__name__": "readme_recipe"}
    exec(compile(code, str(EXTENDING), "exec"), scope)
    records = [json.loads(line) for line in (tmp_path / "atlas" / "gates.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 10, 20] and records[0]["status"] == "BASELINE"
    data = read_artifact(sorted((tmp_path / "atlas" / "receipts").glob("*.json"))[-1])
    assert data["model"]["families"] == ["tiny-moe"] and verify(data) == []
    assert all(lay["selfcheck"]["recombination"] < 1e-3 for lay in data["layers"])


class HandWrittenMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.experts = nn.Linear(8, 4), nn.ModuleList(nn.Linear(8, 8) for _ in range(4))


def test_the_discovery_error_lists_moe_looking_modules_and_points_to_the_recipe():
    model = nn.Sequential(nn.Embedding(10, 8), nn.ModuleDict({"moe": HandWrittenMoE()}))
    with pytest.raises(NoRoutedLayersError) as err:
        find_routed_layers(model)
    assert "MoE-looking modules it saw: 1.moe (HandWrittenMoE)" in str(err.value)
    assert "atlas_tracking.register_family (recipe: docs/extending.md#your-own-moe-module)" in str(err.value)
    assert "## Your own MoE module" in EXTENDING.read_text()
