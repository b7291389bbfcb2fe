"""A tracker that accepts connections and never answers: a real TCP server on 127.0.0.1 that reads nothing
back, used as MLflow's tracking URI by the tests and the delivery benchmark (``benchmarks/tracker_stall.py``).

Example:
    >>> import socket
    >>> with SilentServer() as server:
    ...     conn = socket.create_connection(("127.0.0.1", server.port), timeout=1.0)
    ...     conn.sendall(b"GET / HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
    ...     try:
    ...         conn.recv(1)
    ...     except TimeoutError:
    ...         print("no answer")
    ...     conn.close()
    no answer
"""

from __future__ import annotations

import socket
import threading
from typing import Any


class SilentServer:
    """Listens on 127.0.0.1 (a free port), accepts every connection and keeps it open without a reply."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port: int = self._sock.getsockname()[1]
        self.accepted = 0
        """Connections accepted so far."""
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="silent-server", daemon=True)
        self._thread.start()

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            self._conns.append(conn)
            self.accepted += 1

    def close(self) -> None:
        """Stop listening and drop every connection (a client waiting on one then sees it closed)."""
        self._sock.close()
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> SilentServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
