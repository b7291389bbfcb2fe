"""The generated reference pages say what the code does: every family, configuration key, record field and
tracker key a real gate produces is in the docs, and the docs name nothing the code does not have."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from atlas_tracking import AtlasConfig
from atlas_tracking.adapters.families import FAMILIES, REFUSED
from atlas_tracking.artifacts.load_summary import load_metrics
from atlas_tracking.artifacts.record import gate_metrics
from atlas_tracking.gate import AtlasGate
from atlas_tracking.schema import load as load_schema
from atlas_tracking.schema import record as schema
from atlas_tracking.schema.config import AlertRule
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.tiny import SMALL_GATE, random_canary
from atlas_tracking.viz.reference import attribute_docs, expand

DOCS = Path(__file__).resolve().parents[3] / "docs"


def page(name: str) -> str:
    return expand((DOCS / name).read_text())


def documented_keys(text: str) -> list[re.Pattern]:
    """The tracker keys a page's tables name, as patterns (``NN``: a layer, ``<group>``: a module group, ``<i>``: a
    rank)."""
    documented = set(re.findall(r"^\| `(atlas/[^`]+)` \|", text, re.M))
    return [re.compile("^" + re.escape(k).replace("NN", r"\d\d").replace("<group>", r"\w+").replace("<i>", r"\d+")
                       + "$") for k in documented]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """A baseline and a gate against it on a tiny Qwen3-MoE: every section of a record is present."""
    gate = AtlasGate(family_model("qwen3_moe"), random_canary(), SMALL_GATE, out_dir=tmp_path_factory.mktemp("run"))
    return [gate.run(0, loss=4.0), gate.run(10, loss=3.9)]


def test_the_families_page_lists_every_family_read_and_refused():
    text = page("families.md")
    for row in FAMILIES:
        line = next((x for x in text.splitlines() if x.startswith(f"| `{row.name}` |")), "")
        assert "exact, tested" in line, row.name
    for name, (_, why) in REFUSED.items():
        line = next((x for x in text.splitlines() if x.startswith(f"| `{name}` |")), "")
        assert "refused" in line and why.replace("|", "\\|") in line, name


def test_the_family_table_names_k_zero_experts_and_the_norm_of_each_family():
    lines = page("families.md").splitlines()
    header = next(x for x in lines if x.startswith("| family (model type) |"))
    assert "| k | zero experts | norm |" in header
    rows = {row.name: next(x for x in lines if x.startswith(f"| `{row.name}` |")) for row in FAMILIES}
    assert "| config | yes | RMSNorm |" in rows["longcat_flash"]
    assert "| config | no | (1+w) RMSNorm |" in rows["qwen3_next"]
    assert sum("| yes |" in line for line in rows.values()) == sum(row.zero_experts is not None for row in FAMILIES)


def test_the_configuration_page_lists_every_key():
    text = page("configuration.md")
    for section, values in AtlasConfig().to_dict().items():
        assert f"### `{section}`" in text
        for key in values:
            assert f"| `{key}` |" in text, f"{section}.{key}"
    assert "### `alerts.rules[]`" in text
    for f in dataclasses.fields(AlertRule):
        assert f"| `{f.name}` |" in text, f"alerts.rules[].{f.name}"


def test_every_record_field_of_a_real_gate_is_declared_and_documented(records):
    text = page("record.md")
    declared = set(schema.RECORD_FIELDS)
    layer_declared = set(schema.fields(schema.LayerRecord)) | {schema.BOUNDARY_MASS_KEY}
    for rec in records:
        assert set(rec) <= declared, sorted(set(rec) - declared)
        for layer in rec["layers"]:
            assert set(layer) <= layer_declared, sorted(set(layer) - layer_declared)
    for key in declared | layer_declared - {schema.BOUNDARY_MASS_KEY}:
        assert f"| `{key}` |" in text, key


def test_every_tracker_key_of_a_real_gate_is_documented(records):
    patterns = documented_keys(page("trackers.md"))
    for rec in records:
        for key in gate_metrics(rec):
            assert any(p.match(key) for p in patterns), key
    assert "atlas/kl_base" in gate_metrics(records[1]) and "atlas/status_code" in gate_metrics(records[0])


def test_a_placeholder_with_an_unknown_name_is_an_error():
    with pytest.raises(KeyError, match="unknown generated section 'nope'"):
        expand("<!-- generated: nope -->\n")


def test_every_training_batch_key_is_documented_and_no_other():
    """Every key an interval can send (an expert-parallel layer with a capacity limit: every optional summary, and
    ranked experts up to 5), and the picture and table, are in the tracker-key table; the table names no
    ``atlas/train/`` key the code does not send."""
    text = page("trackers.md")
    line = {"step": 20, "tokens": 64, "layers": [
        {"layer": 0, "name": "a", "load": [40, 30, 20, 10, 10, 10, 5, 3], "dropped": 4, "ep_tokens": [70, 58]},
        {"layer": 1, "name": "b", "load": [16] * 8, "dropped": 0, "ep_tokens": [64, 64]}],
        "breach": [{"layer": 0}], "alarm": True}
    metrics = load_metrics(line, top=5)
    assert set(load_schema.SUMMARY_KEYS.values()) <= set(metrics)
    patterns = documented_keys(text)
    for key in [*metrics, "atlas/train/experts", "atlas/train/expert_load"]:
        assert any(p.match(key) for p in patterns), key
    rows = re.findall(r"^\| `(atlas/train/[^`]+)` \|", text, re.M)
    ranked = [k.replace("1_", "<i>_") for k in load_schema.ranked_keys(1)]
    assert rows == [*load_schema.SUMMARY_KEYS.values(), *ranked, "atlas/train/experts", "atlas/train/expert_load"]


def test_the_telemetry_page_lists_every_field_of_a_load_line():
    text = page("telemetry.md")
    for cls in (load_schema.LoadLine, load_schema.LoadLayer):
        section = text.split(f"### {cls.__name__} (", 1)[1].split("\n#", 1)[0]
        rows = {cells[1].strip(): cells[3].strip() for cells in
                (re.split(r"(?<!\\)\|", x) for x in section.splitlines() if x.startswith("| `"))}
        assert list(rows) == [f"`{key}`" for key in schema.fields(cls)]
        assert all(rows.values()), rows  # every field has its meaning


def test_per_layer_tracker_keys_carry_their_meaning():
    """The per-layer keys' meanings come from the sections :class:`LayerRecord` is built from (a TypedDict's
    bases are not in its MRO)."""
    text = page("trackers.md")
    line = next(x for x in text.splitlines() if x.startswith("| `atlas/layer_NN/c2` |"))
    assert line.endswith(f"| {attribute_docs(schema.LayerReceipts)['c2']} |")
