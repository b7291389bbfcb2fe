"""``benchmarks/gpu_check.py`` (``make gpu-check``) on a machine without CUDA: its smoke sizes run every section
that needs no GPU to the end, and a pytest junit XML is read back with each test's outcome and recorded
properties (what the GPU run's JSON reports of the tests marked ``gpu``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import atlas_tracking
from atlas_tracking.testing.bench import rename_package


def test_junit_outcomes_and_properties_are_read_back(script, tmp_path):
    gpu_check = script("benchmarks/gpu_check.py")
    (tmp_path / "test_probe.py").write_text(
        "import pytest\n"
        "def test_records(record_property):\n    record_property('deviation', 2.5e-6)\n"
        "def test_fails():\n    assert 1 == 2\n"
        "@pytest.mark.skip(reason='not here')\ndef test_skipped():\n    pass\n")
    xml = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                    "-c", "/dev/null", f"--junitxml={xml}", str(tmp_path / "test_probe.py")],
                   capture_output=True, cwd=tmp_path, timeout=120)
    got = gpu_check.junit_results(xml)
    assert got["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    by_name = {name.split("::")[-1]: entry for name, entry in got["tests"].items()}
    assert by_name["test_records"] == {"outcome": "passed", "deviation": 2.5e-6}
    assert by_name["test_fails"]["outcome"] == "failed" and "assert 1 == 2" in by_name["test_fails"]["detail"]
    assert by_name["test_skipped"] == {"outcome": "skipped", "detail": "not here"}


def test_smoke_sections_run_and_write_one_json(script, tmp_path):
    """The smoke sizes, with a copy of this package renamed as an earlier commit's is (``--prepare-before``) timed
    beside this tree's gate."""
    gpu_check = script("benchmarks/gpu_check.py")
    out = tmp_path / "gpu_check.json"
    before = rename_package(shutil.copytree(Path(atlas_tracking.__file__).parent, tmp_path / "atlas_tracking",
                                            ignore=shutil.ignore_patterns("__pycache__")), "atlas_tracking_earlier")
    assert gpu_check.main(["--smoke", "--only", "realistic", "profile", "--out", str(out), "--before", str(before)]) == 0
    result = json.loads(out.read_text())
    assert result["smoke"] is True and result["environment"]["device"] == "cpu"
    assert result["realistic"]["before"] == "atlas_tracking_earlier"
    rows = result["realistic"]["rows"]
    assert [r["experts"] for r in rows] == [16, 32] and all(r["gate"] > 0 and r["plain"] > 0 for r in rows)
    assert all(r["gate_before"] > 0 and r["ratio_before"] == r["gate_before"] / r["plain"] for r in rows)
    assert [s["tokens"] for s in rows[1]["canary_tokens_scaling"]] == [256, 512, 1024]
    assert result["profile"]["gate"]["host_ms_total"] > 0 and result["profile"]["plain"]["host_ms_total"] > 0


def test_before_must_name_a_package(script, tmp_path):
    with pytest.raises(SystemExit):
        script("benchmarks/gpu_check.py").main(["--smoke", "--before", str(tmp_path)])
