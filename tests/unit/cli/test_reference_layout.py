"""Every command that reads a reference or a baseline refuses one measured on other routed layers or another
canary, naming the difference, before anything is measured: ``compare --reference`` (a receipts artifact or a
baseline directory) as ``measure --baseline`` does; the right reference is read as before."""

from __future__ import annotations

import re

import pytest

from atlas_tracking.cli import main
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.tiny import random_canary


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    family_model("qwen3_moe", num_experts=8).save_pretrained(root / "eight")
    family_model("qwen3_moe", num_experts=4).save_pretrained(root / "four")
    random_canary().save(root / "canary.npz")
    random_canary(seed=1).save(root / "other.npz")
    for name, canary in (("four", "canary"), ("eight", "canary"), ("other", "other")):
        model = "eight" if name == "other" else name
        assert main(["measure", "--model", str(root / model), "--canary", str(root / f"{canary}.npz"), "--out",
                     str(root / f"{name}.json"), "--save-baseline", str(root / f"{name}_baseline"), "--quiet"]) == 0
    return root


def _compare(root, out, reference) -> list[str]:
    return ["compare", "--base", str(root / "eight"), "--candidate", str(root / "eight"), "--canary",
            str(root / "canary.npz"), "--out", str(out), "--no-exact-kl", "--quiet", "--reference", str(reference)]


@pytest.mark.parametrize(("reference", "difference"), [
    ("four.json", r"routed layer model\.layers\.0\.mlp: num_experts 4 vs 8"),
    ("four_baseline", r"routed layer model\.layers\.0\.mlp: num_experts 4 vs 8"),
    ("other.json", r"canary fingerprint mismatch"),
])
def test_compare_refuses_a_reference_of_another_layout(models, tmp_path, capsys, reference, difference):
    capsys.readouterr()
    out = tmp_path / "drift.json"
    assert main(_compare(models, out, models / reference)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"handoff reference {models / reference}" in err, err
    assert re.search(difference, err), err
    assert not out.exists()


def test_measure_baseline_refuses_the_same_file(models, tmp_path, capsys):
    capsys.readouterr()
    out = tmp_path / "r.json"
    assert main(["measure", "--model", str(models / "eight"), "--canary", str(models / "canary.npz"), "--out",
                 str(out), "--baseline", str(models / "four_baseline"), "--quiet"]) == 2
    assert "num_experts 4 vs 8" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("reference", ["eight.json", "eight_baseline"])
def test_compare_reads_the_right_reference(models, tmp_path, capsys, reference):
    capsys.readouterr()
    assert main(_compare(models, tmp_path / "drift.json", models / reference)) == 0
    assert "handoff_margin=+0.0000" in capsys.readouterr().out  # the base against its own receipts
