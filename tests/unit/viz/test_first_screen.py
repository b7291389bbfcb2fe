"""The report's first screen answers, in order, the verdict and why, where (the worst layers by the model's own
layer numbers, the experts involved, the layers x experts picture) and what to do (the first intervention with
the lines that carry it out); docs references and table rows are links; a layer has one name; the C2 heatmap shows
the change since the baseline; drift and cliff numbers carry their unit. Read on a real gate pair
(:mod:`atlas_tracking.testing.overload`), parsed as HTML and rendered by the system Chromium."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import numpy as np
import pytest

from atlas_tracking.cli.app import main
from atlas_tracking.schema.interventions import FRAMEWORKS, RECIPES
from atlas_tracking.schema.verdict import gate_verdict
from atlas_tracking.testing.browser import CHROMIUM, first_screen
from atlas_tracking.viz.figures import c2_change_row, fig_c2_heatmap, pyplot
from atlas_tracking.viz.html_report import write_report

DOCS = "https://docs.example.org/atlas/"


class Page(HTMLParser):
    """The page as a list of (tag path, text) pieces, and each element's attributes in document order."""

    def __init__(self, text: str):
        super().__init__()
        self.stack: list[tuple[str, dict[str, str]]] = []
        self.texts: list[tuple[tuple[str, ...], str]] = []
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = {k: v or "" for k, v in attrs}
        self.elements.append((tag, attrs))
        if tag not in ("img", "br", "meta"):
            self.stack.append((tag, attrs))

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop()[0] != tag:
            pass

    def handle_data(self, data):
        path = tuple(f"{t}.{a.get('class', '')}" for t, a in self.stack)
        self.texts.append((path, data))

    def visible(self, skip: tuple[str, ...] = ("style", "title")) -> str:
        """The text outside the tags named in ``skip`` (prefixes of ``tag.class``)."""
        return " ".join(text for path, text in self.texts
                       if not any(p.startswith(s) for p in path for s in skip))


@pytest.fixture(scope="module")
def report(overloaded_run, tmp_path_factory):
    path = write_report(overloaded_run["dir"], tmp_path_factory.mktemp("report") / "report.html", docs_url=DOCS)
    return path, path.read_text()


def test_first_section_holds_verdict_worst_layers_and_intervention_in_order(overloaded_run, report):
    base, last = overloaded_run["records"]
    page = report[1]
    section = page.split('<section id="first-screen">')[1].split("</section>")[0]
    marks = [section.find(m) for m in ('class="status"', 'class="why"', 'class="worst-layers"',
                                        'alt="expert load change: layers x experts"', 'class="intervention"')]
    assert -1 not in marks and marks == sorted(marks), marks
    # the worst layers, by the model's own layer numbers, ordered by their C2 change since the baseline (worst first)
    expected = sorted(last["layers"], key=lambda lay: lay["c2"] - next(
        b["c2"] for b in base["layers"] if b["name"] == lay["name"]))
    rows = re.findall(r'<tr data-layer="([^"]+)"><td><span class="layer" title="([^"]+)">', section)
    assert rows == [(f"layer {lay['index']}", lay["name"]) for lay in expected]
    # the first intervention: the record's action with each framework's lines
    intervention = section.split('class="intervention"')[1]
    assert last["intervention"] == RECIPES["overlap_and_occupancy"].action
    assert last["intervention"] in intervention.replace("&#x27;", "'")
    pres = re.findall(r"<b>([^<]+)</b><pre>([^<]+)</pre>", intervention)
    assert [name for name, _ in pres] == list(FRAMEWORKS)
    lines = dict(pres)
    assert "router_aux_loss_coef" in lines["transformers Trainer"] and "moe_aux_loss_coeff" in lines["Megatron-Core"]
    assert "l_aux" in lines["DeepSpeed"] and "output_router_logits" in lines["Lightning"]


def test_docs_references_and_table_rows_are_links(report):
    page = Page(report[1])
    outside = page.visible(skip=("style", "title", "a.", "pre", "code"))
    assert not re.search(r"docs/[\w-]+\.md", outside), re.findall(r".{40}docs/[\w-]+\.md.{20}", outside)
    assert not re.search(r"Table \d+ row", outside)
    hrefs = [a.get("href") for tag, a in page.elements if tag == "a"]
    assert f"{DOCS}policy/#first-interventions" in hrefs
    assert f"{DOCS}policy/#stage-transitions" in hrefs  # the rule: Table 13 row 1, first bad gate
    assert f"{DOCS}receipts/#near-tie-mass" in hrefs
    assert all(h.startswith(DOCS) or h.startswith("#") for h in hrefs), hrefs


def test_each_layer_has_one_name(overloaded_run, report):
    last = overloaded_run["records"][-1]
    page = Page(report[1])
    text = page.visible(skip=("style", "title", "code.module", "pre"))
    assert not re.search(r"[A-Za-z_]\.\d+\.[A-Za-z_]", text), re.findall(r".{30}[A-Za-z_]\.\d+\.[A-Za-z_].{10}", text)
    for lay in last["layers"]:
        assert f"layer {lay['index']}" in text
    titles = {a["title"] for tag, a in page.elements if tag == "span" and "layer" in a.get("class", "")}
    assert titles == {lay["name"] for lay in last["layers"]}


def test_heatmap_colours_the_change_since_the_baseline(overloaded_run, report):
    base, last = overloaded_run["records"]
    history = [(r["step"], c2_change_row(r)) for r in (base, last)]
    fig = fig_c2_heatmap(history, ["layer 0", "layer 1"])
    try:
        image = fig.axes[0].images[0]
        grid = np.asarray(image.get_array())
        vmin, vmax = image.get_clim()
        cmap = image.get_cmap().name
    finally:
        pyplot().close(fig)
    for i, (b, lay) in enumerate(zip(base["layers"], last["layers"])):
        assert grid[i, 0] == 0.0  # the baseline gate: no change
        assert grid[i, 1] == pytest.approx(lay["c2"] - b["c2"], abs=1e-9)
    assert vmin == -vmax and cmap == "RdBu"  # diverging, zero in the middle
    assert "C2 change since its gate&#x27;s baseline" in report[1] or "C2 change since its gate's baseline" in report[1]


def test_drift_and_cliff_numbers_carry_their_unit_and_meaning(report):
    page = report[1]
    cliff = page.split("<h2>Terminal cliff (last gate)</h2>")[1].split("<h2>")[0]
    assert "share of a token&#x27;s k experts" in cliff and "ov_cf (share of k kept)" in cliff
    drift = page.split("<h2>Parameter drift")[1].split("<h2>")[0]
    assert "relative L2 distance" in drift and ("0: unchanged" in drift or "No parameter drift recorded" in drift)


def test_gates_command_opens_with_verdict_where_and_what(overloaded_run, capsys):
    last = overloaded_run["records"][-1]
    assert main(["gates", str(overloaded_run["dir"] / "atlas")]) == 0
    lines = capsys.readouterr().out.splitlines()
    worst = min(last["layers"], key=lambda lay: lay["c2_delta"])
    assert lines[0].startswith(f"verdict: {gate_verdict(last).headline()} at step {last['step']}")
    assert lines[1].startswith(f"where: layer {worst['index']}")
    assert lines[2] == f"what to do: {last['intervention']}"
    assert lines.index(next(x for x in lines if x.startswith("step "))) > 2  # the table comes after


def test_first_screen_is_within_the_top_900_px_in_a_real_browser(report, tmp_path):
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the dev extra)")
    if not CHROMIUM.exists():
        pytest.skip(f"no system chromium at {CHROMIUM}")
    boxes = first_screen(report[0], tmp_path / "top.png")
    for part, box in boxes.items():
        assert box is not None and box["bottom"] <= 900, (part, box)
    assert boxes["load picture"]["left"] >= boxes["worst layers"]["right"]  # beside the table
    assert (tmp_path / "top.png").read_bytes()[:4] == b"\x89PNG"
