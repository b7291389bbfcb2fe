"""``benchmarks/host_report.py``: the host passes of a gate (its report, and the drift of a gate against a baseline)
are the package's own, give what ``measure`` gives, and are timed per pass and per routed layer."""

from __future__ import annotations

import json

import atlas_tracking
from atlas_tracking import AtlasConfig, Baseline, Canary, measure
from atlas_tracking.testing.bench import gate_bench_inputs


def test_the_host_passes_give_what_a_gate_gives_and_are_timed_per_layer(script, tmp_path):
    bench = script("benchmarks/host_report.py")
    model, canary = gate_bench_inputs(32, layers=2, windows=4)
    ids = canary.windows.reshape(-1)
    passes, outputs = bench.host_passes(atlas_tracking, model, ids, 4, 128)
    cfg = AtlasConfig.from_dict({"receipts": {"progress": False}})
    same = Canary.from_token_ids(ids, window=128, n_windows=4, seed=0)
    gate = measure(model, same, config=cfg, keep_anchors=False)
    assert json.loads(outputs["report"])["layers"] == json.loads(gate.to_json())["layers"]
    Baseline.from_report(measure(model, same, config=cfg)).save(tmp_path / "b")
    baseline = Baseline.load(tmp_path / "b")
    assert json.loads(outputs["drift"]) == json.loads(json.dumps(measure(model, same, baseline=baseline,
                                                                         config=cfg).drift))
    assert set(passes) == {"report", "drift"}
    out = tmp_path / "host_report.json"
    assert bench.main(["--width", "32", "--layers", "2", "--canary", "4x64", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["canary"] == [4, 64] and set(result["cpu_ms_median"]) == {"after_report", "after_drift"}
    assert all(result["cpu_ms_per_layer"][k] * 2 == result["cpu_ms_median"][k] for k in result["cpu_ms_median"])
