"""``report`` and ``verify`` given a ``compare`` artifact say what it is and which command wrote it."""

from __future__ import annotations

from atlas_tracking.cli import main
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.tiny import random_canary


def test_report_and_verify_name_a_compare_artifact(tmp_path, capsys):
    family_model("qwen3_moe").save_pretrained(tmp_path / "model")
    random_canary().save(tmp_path / "canary.npz")
    drift = tmp_path / "drift.json"
    assert main(["compare", "--base", str(tmp_path / "model"), "--candidate", str(tmp_path / "model"), "--canary",
                 str(tmp_path / "canary.npz"), "--out", str(drift), "--no-exact-kl"]) == 0
    capsys.readouterr()
    for argv in (["verify", str(drift)], ["report", str(drift), "--out", str(tmp_path / "r.html")]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert "is a compare artifact" in err and "written by `atlas-tracking compare`" in err, err
    assert not (tmp_path / "r.html").exists()
