"""The embedded Prefect server: `prefect server start` on SQLite under <workdir>/.prefect.

Started in the background once and reused by later commands; the client side only needs
PREFECT_API_URL. Prefect's ephemeral server is not used: its 20 s start-up timeout fails on a
fresh home on a slow machine. A healthy listener on the port is reused only when the workdir's pid
file names a live ``prefect server start`` on that port: anything else answering there (another
user's server, another workdir's) would receive this workdir's flow runs, so start() refuses it.
It binds 127.0.0.1 only; a server for other machines is set up as docs/operations.md describes.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from infra.process import kill_group, pid_alive, process_cmdline, read_pid_file, spawn_detached, tail, write_pid_file

DEFAULT_PORT = 4200
STARTUP_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class LocalServer:
    """Where the local server keeps its state and answers."""

    home: Path
    port: int = DEFAULT_PORT

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.home / "server.pid"

    @property
    def log_file(self) -> Path:
        return self.home / "server.log"

    def client_env(self) -> dict[str, str]:
        """Environment for processes that talk to this server (flows, workers, the prefect CLI)."""
        return {"PREFECT_HOME": str(self.home.resolve()), "PREFECT_API_URL": self.api_url,
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str((self.home / "storage").resolve())}


def for_workdir(workdir: str | Path, port: int | None = None) -> LocalServer:
    """The local server for a workdir (port from EAGLE3_PREFECT_PORT or 4200)."""
    port = port or int(os.environ.get("EAGLE3_PREFECT_PORT", DEFAULT_PORT))
    return LocalServer(Path(workdir) / ".prefect", port)


def healthy(server: LocalServer, timeout_s: float = 2.0) -> bool:
    """True when /api/health answers 200."""
    try:
        return httpx.get(f"{server.api_url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


class ForeignServerError(RuntimeError):
    """Something other than this workdir's server answers on its port."""


def owner_problem(server: LocalServer) -> str | None:
    """Why the process on the server's port is not the one this workdir started (None when it is ours)."""
    pid = read_pid_file(server.pid_file)
    if pid is None:
        return f"there is no pid file {server.pid_file}"
    argv = process_cmdline(pid) if pid_alive(pid) else None
    if argv is None:
        return f"pid {pid} of {server.pid_file} is not running"
    port_flag = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--port"]
    if not ("server" in argv and "start" in argv and port_flag == [str(server.port)]):
        return f"pid {pid} of {server.pid_file} is not `prefect server start --port {server.port}` ({' '.join(argv)})"
    return None


def start(server: LocalServer, timeout_s: float = STARTUP_TIMEOUT_S) -> str:
    """Start the server unless ours already answers; wait for health. Returns 'reused' or 'started'."""
    if healthy(server):
        problem = owner_problem(server)
        if problem:
            raise ForeignServerError(f"{server.api_url} answers, but it is not the Prefect server of this workdir "
                                     f"({problem}); stop that server or pick another port (EAGLE3_PREFECT_PORT)")
        return "reused"
    server.home.mkdir(parents=True, exist_ok=True)
    prefect = str(Path(sys.executable).with_name("prefect"))
    argv = [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(server.port)]
    pid = spawn_detached(argv, server.log_file, env={**os.environ, **server.client_env()})
    write_pid_file(server.pid_file, pid)
    _wait_healthy(server, pid, timeout_s)
    return "started"


def _wait_healthy(server: LocalServer, pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if healthy(server):
            return
        if not pid_alive(pid):
            raise RuntimeError(f"prefect server exited during start-up; log {server.log_file}:\n{tail(server.log_file)}")
        time.sleep(1.0)
    raise TimeoutError(f"prefect server not healthy after {timeout_s:.0f} s; log {server.log_file}:\n"
                       f"{tail(server.log_file)}")


def stop(server: LocalServer) -> bool:
    """Stop the server this workdir started (its whole process group). True if one was running."""
    pid = read_pid_file(server.pid_file)
    if pid is None or not pid_alive(pid):
        server.pid_file.unlink(missing_ok=True)
        return False
    kill_group(pid, grace_s=15.0)
    server.pid_file.unlink(missing_ok=True)
    return True


def status(server: LocalServer) -> dict[str, object]:
    """pid, health and URLs."""
    pid = read_pid_file(server.pid_file)
    return {"healthy": healthy(server), "pid": pid if pid and pid_alive(pid) else None,
            "ui": server.ui_url, "api": server.api_url, "home": str(server.home), "log": str(server.log_file)}
