"""A real MLflow tracking server for the tests: ``mlflow server`` on 127.0.0.1 (a free port) with a sqlite backend and
a local artifact root, started and stopped as a process group (the tests stop it to play a tracker outage).

Example (not run here: a server takes seconds to start)::

    server = MlflowServer(tmp_path / "mlflow")
    server.start()
    client = MlflowClient(tracking_uri=server.uri)
    ...
    server.stop()
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one listens on now.

    >>> 0 < free_port() < 65536
    True
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """A real ``mlflow server`` on 127.0.0.1 with a sqlite backend and a local artifact root under ``root``; a
    restart keeps its port and store."""

    def __init__(self, root: Path):
        self.root, self.port, self.proc = Path(root), free_port(), None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0) -> None:
        """Start the server and wait until it answers ``/health``."""
        cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--default-artifact-root", str(self.root / "artifacts"), "--host", "127.0.0.1",
               "--port", str(self.port), "--workers", "1"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("mlflow server did not start")

    def stop(self) -> None:
        """Stop the server (its whole process group) and wait for it."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
            self.proc = None
