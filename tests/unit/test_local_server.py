"""flows.local_server: a healthy listener on the port is reused only when the workdir's pid file names it."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flows.local_server import ForeignServerError, LocalServer, owner_problem, start
from infra.process import write_pid_file


class _Health(BaseHTTPRequestHandler):
    """A FAKE listener that answers /api/health like any Prefect server would."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/api/health" else 404)
        self.end_headers()
        self.wfile.write(b"true")

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _someone_elses_server() -> Iterator[int]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


@contextmanager
def _process(*argv: str) -> Iterator[int]:
    """A sleeping process whose command line ends with ``argv`` (what the pid check reads)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *argv])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_healthy_listener_without_our_pid_file_is_not_reused(tmp_path):
    """Another server on the port (no pid file, or a pid file of a dead or different process) is refused."""
    with _someone_elses_server() as port:
        server = LocalServer(tmp_path / ".prefect", port)
        with pytest.raises(ForeignServerError, match="no pid file"):
            start(server, timeout_s=1)
        server.home.mkdir(parents=True)
        with _process("server", "start", "--port", str(port + 1)) as pid:
            write_pid_file(server.pid_file, pid)
            with pytest.raises(ForeignServerError, match=f"is not `prefect server start --port {port}`"):
                start(server, timeout_s=1)
        with pytest.raises(ForeignServerError, match="is not running"):
            start(server, timeout_s=1)


def test_our_own_live_server_is_reused(tmp_path):
    """When the pid file names a live `... server start ... --port P` process, the listener on P is reused."""
    with _someone_elses_server() as port:
        server = LocalServer(tmp_path / ".prefect", port)
        server.home.mkdir(parents=True)
        with _process("server", "start", "--host", "127.0.0.1", "--port", str(port)) as pid:
            write_pid_file(server.pid_file, pid)
            assert owner_problem(server) is None
            assert start(server, timeout_s=1) == "reused"
