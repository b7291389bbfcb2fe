"""Callback options: geometry-aware checkpoints, the alert webhook (secret URL), LightningCLI YAML."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import ClassVar

import lightning.pytorch as pl
import pytest
from atlas_tracking.integrations.lightning import AtlasCallback

from atlas_tracking.testing.tiny import QUIET, tiny_canary, tiny_data, tiny_module

LENIENT = {**QUIET, "policy": {"phase": "post_training", "c2_tol": 1.0, "dead_tol": 100.0, "entropy_tol": 10.0, "cv_tol": 1000.0}}
STRICT = {**QUIET, "policy": {"phase": "post_training", "c2_tol": 0.0, "dead_tol": 0.0, "entropy_tol": 0.0, "cv_tol": 0.0, "use_ci": False}}


def _fit(tmp_path, callbacks, steps=40):
    train, val = tiny_data(steps)
    trainer = pl.Trainer(max_steps=steps, val_check_interval=10, check_val_every_n_epoch=None, logger=False,
                         default_root_dir=str(tmp_path), callbacks=callbacks, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1,
                         enable_checkpointing=False)
    trainer.fit(tiny_module(), train, val)
    return trainer


def test_checkpoint_on_green_keeps_the_last_n(tmp_path):
    cfg = {**LENIENT, "gate": {"checkpoint_on_green": True, "keep_green_checkpoints": 2}}
    _fit(tmp_path, [AtlasCallback(canary=tiny_canary(), config=cfg)])
    records = [json.loads(x) for x in (tmp_path / "atlas" / "gates.jsonl").read_text().splitlines()]
    assert [(r["step"], r["status"], r["stage"]) for r in records[1:]] == [(s, "GREEN", "clean") for s in (10, 20, 30, 40)]
    kept = sorted(p.name for p in (tmp_path / "atlas" / "green").iterdir())
    assert kept == ["step=00000030.ckpt", "step=00000040.ckpt"]


class _Hook(BaseHTTPRequestHandler):
    received: ClassVar[list] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Hook.received.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        return None


def test_webhook_receives_alert_json_and_the_url_is_never_written(tmp_path, monkeypatch, caplog, recwarn):
    server = HTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/secret-token-abc123"
    monkeypatch.setenv("ATLAS_WEBHOOK_URL", url)
    _Hook.received.clear()
    try:
        _fit(tmp_path, [AtlasCallback(canary=tiny_canary(), config=STRICT)], steps=20)
    finally:
        server.shutdown()
    assert any("revoked" in event["title"] for event in _Hook.received)
    assert {"title", "text", "level", "step"} <= set(_Hook.received[0])
    written = "".join(p.read_text(errors="ignore") for p in (tmp_path / "atlas").rglob("*") if p.is_file()
                      and p.suffix in (".json", ".jsonl"))
    assert "secret-token-abc123" not in written
    assert "secret-token-abc123" not in caplog.text
    assert all("secret-token-abc123" not in str(w.message) for w in recwarn)


def test_webhook_that_is_down_is_a_warning_without_the_url(tmp_path, monkeypatch, recwarn):
    monkeypatch.setenv("ATLAS_WEBHOOK_URL", "http://127.0.0.1:9/secret-token-xyz")
    _fit(tmp_path, [AtlasCallback(canary=tiny_canary(), config=STRICT)], steps=20)
    messages = [str(w.message) for w in recwarn if "webhook" in str(w.message)]
    assert messages and all("secret-token-xyz" not in m for m in messages)


CLI_MODULE = '''
from lightning.pytorch.cli import LightningCLI
from atlas_tracking.testing.tiny import tiny_data
from atlas_tracking.testing.lightning_lm import MoELM, build_qwen3_moe


class Module(MoELM):
    def __init__(self):
        super().__init__(build_qwen3_moe(seed=0, hidden=32, layers=2, experts=8), lr=3e-3)

    def train_dataloader(self):
        return tiny_data(10)[0]

    def val_dataloader(self):
        return tiny_data(10)[1]


LightningCLI(Module, args=["fit", "--config", {config!r}])
'''


def _lightning_cli(tmp_path, atlas_config: str, trainer: str = "") -> subprocess.CompletedProcess:
    """``LightningCLI fit`` of the tiny module in a child process, with AtlasCallback configured in its YAML
    (``atlas_config`` is the callback's ``config`` value, ``trainer`` more YAML lines of the trainer)."""
    tiny_canary().save(tmp_path / "canary.npz")
    config = tmp_path / "cli.yaml"
    config.write_text(f"""
trainer:
  max_steps: 10
  logger: false
  enable_checkpointing: false
  accelerator: cpu
  default_root_dir: {tmp_path}{trainer}
  callbacks:
    - class_path: atlas_tracking.integrations.lightning.AtlasCallback
      init_args:
        canary: {tmp_path / 'canary.npz'}
        config: {atlas_config}
""")
    script = tmp_path / "cli.py"
    script.write_text(CLI_MODULE.format(config=str(config)))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)


def test_usable_from_lightning_cli_yaml(tmp_path):
    pytest.importorskip("jsonargparse")
    (tmp_path / "atlas.yaml").write_text(json.dumps(QUIET))
    proc = _lightning_cli(tmp_path, str(tmp_path / "atlas.yaml"), trainer="""
  val_check_interval: 10
  check_val_every_n_epoch: null
  enable_progress_bar: false""")
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(x) for x in (tmp_path / "atlas" / "gates.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 10]


def test_lightning_cli_wrong_config_key_is_said_first(tmp_path):
    """One wrong key in the callback's atlas config: the error naming it comes before the parser's traceback."""
    proc = _lightning_cli(tmp_path, "{policy: {c2_toll: 0.1}}")
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode != 0
    first = next(i for i, line in enumerate(lines) if "unknown key 'policy.c2_toll'" in line)
    assert first < 8, "\n".join(lines[:first + 1])
    assert "allowed keys: " in lines[first] and "c2_tol" in lines[first].split("allowed keys: ")[1]
