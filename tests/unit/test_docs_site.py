"""The documentation builds strictly (no broken link, anchor or page left out of the navigation), and neither
the docs nor the code cite a file outside the repository."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_make_docs_builds_strictly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"),
                           "--config-file", str(ROOT / "mkdocs.yml")], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-3000:]
    built = {p.relative_to(tmp_path / "site").parts[0] for p in (tmp_path / "site").rglob("index.html")}
    pages = {p.stem for p in (ROOT / "docs").glob("*.md") if p.stem != "index"}
    assert pages <= built, sorted(pages - built)


def test_nothing_cites_a_file_outside_the_repository():
    outside = re.compile(r"RECEIPTS\.md|seeds/0|DESIGN\.md|\.\./shared")
    offenders = []
    for folder in ("atlas_tracking", "integrations", "docs", "examples", "benchmarks", "tests"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md", ".yml", ".yaml") and path != Path(__file__).resolve() \
                    and outside.search(path.read_text(errors="ignore")):
                offenders.append(str(path.relative_to(ROOT)))
    for name in ("README.md", "mkdocs.yml", "pyproject.toml", "Makefile"):
        if outside.search((ROOT / name).read_text()):
            offenders.append(name)
    assert not offenders, offenders
