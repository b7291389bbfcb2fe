"""Command-line errors: one line on stderr, exit code 2, and nothing written."""

from __future__ import annotations

import numpy as np
import pytest

from atlas_tracking.cli import main
from atlas_tracking.testing.families import family_model
from atlas_tracking.testing.tiny import random_canary


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    family_model("qwen3_moe").save_pretrained(root / "model")
    random_canary().save(root / "canary.npz")
    return root


def test_cli_errors_are_one_line_and_write_nothing(ckpt, tmp_path, capsys):
    out = tmp_path / "r.json"
    np.save(tmp_path / "floats.npy", np.zeros((2, 8), dtype=np.float32))
    cases = [
        (["measure", "--model", str(ckpt / "model"), "--canary", str(tmp_path / "floats.npy"), "--out", str(out)],
         "canary token ids must be integers"),
        (["measure", "--model", str(tmp_path), "--canary", str(ckpt / "canary.npz"), "--out", str(out)],
         "is not a transformers checkpoint directory"),
        (["measure", "--model", str(ckpt / "model"), "--canary", str(tmp_path / "missing.npz"), "--out", str(out)],
         "canary file not found"),
        (["verify", str(tmp_path / "missing.json")], "cannot read receipts artifact"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1
        assert not out.exists()
