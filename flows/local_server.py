"""The embedded Prefect server: `prefect server start` on SQLite under <workdir>/.prefect, or on PostgreSQL.

The database is SQLite unless a URL is given (`eagle3 server start --database URL`, or Prefect's own
PREFECT_SERVER_DATABASE_CONNECTION_URL in the environment): `postgresql+asyncpg://user:pass@host:5432/db`.
The URL goes to the server process only (clients talk HTTP); its password-masked form is kept beside the pid
file, so `status` shows it and a later start that asks for another database refuses to reuse the running one.

Started in the background once and reused by later commands; the client side only needs
PREFECT_API_URL. Prefect's ephemeral server is not used: its 20 s start-up timeout fails on a
fresh home on a slow machine. A healthy listener on the port is reused only when the workdir's pid
file names a live ``prefect server start`` on that port: anything else answering there (another
user's server, another workdir's) would receive this workdir's flow runs, so start() refuses it.
It binds 127.0.0.1 only; a server for other machines is set up as docs/operations.md describes.

On SQLite the server runs through flows.prefect_server with SQLITE_ENV: every transaction takes the write lock at
BEGIN, so concurrent submissions while a pipeline runs wait for it instead of failing with 503 `database is
locked` (issue 39, list 1, item 1; measured with scripts/submit_load.py, docs/operations.md).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx

from infra.process import kill_group, pid_alive, process_cmdline, read_pid_file, spawn_detached, tail, write_pid_file

DEFAULT_PORT = 4200
STARTUP_TIMEOUT_S = 240.0
DATABASE_ENV = "PREFECT_SERVER_DATABASE_CONNECTION_URL"  # Prefect's setting (older alias: PREFECT_API_DATABASE_...)
DATABASE_SCHEMES = ("postgresql+asyncpg", "sqlite+aiosqlite")  # the async drivers Prefect's server runs on
# SQLite only: BEGIN IMMEDIATE for every transaction (flows/prefect_server.py says why; no Prefect setting does it)
SQLITE_ENV = {"EAGLE3_SQLITE_BEGIN_IMMEDIATE": "1"}
# The server process marks overdue runs Late with the reason they wait (flows/waiting.py), instead of Prefect's
# late-runs service, which writes no reason (one writer of Late; same PREFECT_SERVER_SERVICES_LATE_RUNS_* settings)
LATE_RUNS_ENV = {"EAGLE3_LATE_RUNS_WATCHER": "1", "PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED": "false"}


@dataclass(frozen=True)
class LocalServer:
    """Where the local server keeps its state and answers."""

    home: Path
    port: int = DEFAULT_PORT
    database_url: str | None = None  # None: SQLite under home (or PREFECT_SERVER_DATABASE_CONNECTION_URL if set)
    sqlite_settings: bool = True  # SQLITE_ENV on SQLite (False: Prefect's defaults, for scripts/submit_load.py)

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

    @property
    def database_file(self) -> Path:
        return self.home / "server.database"

    def database(self) -> str:
        """The database this server is to use, password masked ("sqlite" for Prefect's default)."""
        url = self.database_url or os.environ.get(DATABASE_ENV)
        return mask_password(url) if url else "sqlite"

    def server_env(self) -> dict[str, str]:
        """Environment of the `prefect server start` process: the client's, the bind address (so the UI's API URL
        names this port, which `--port` alone does not set), LATE_RUNS_ENV, the database URL when one is given, and
        SQLITE_ENV when the database is SQLite."""
        env = {
            **self.client_env(),
            "PREFECT_SERVER_API_HOST": "127.0.0.1",
            "PREFECT_SERVER_API_PORT": str(self.port),
            **LATE_RUNS_ENV,
        }
        env |= {DATABASE_ENV: self.database_url} if self.database_url else {}
        return env | (SQLITE_ENV if self.sqlite_settings and self.database().startswith("sqlite") else {})

    def client_env(self) -> dict[str, str]:
        """Environment for processes that talk to this server (flows, workers, the prefect CLI)."""
        return {
            "PREFECT_HOME": str(self.home.resolve()),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str((self.home / "storage").resolve()),
        }


def for_workdir(workdir: str | Path, port: int | None = None, database_url: str | None = None) -> LocalServer:
    """The local server for a workdir (port from EAGLE3_PREFECT_PORT or 4200; database SQLite unless given)."""
    port = port or int(os.environ.get("EAGLE3_PREFECT_PORT", DEFAULT_PORT))
    return LocalServer(Path(workdir) / ".prefect", port, check_database_url(database_url) if database_url else None)


def check_database_url(url: str) -> str:
    """The URL itself when Prefect's server can use it; else a ValueError saying which form it needs."""
    scheme = urlsplit(url).scheme
    if scheme not in DATABASE_SCHEMES:
        hint = " (add the async driver: postgresql+asyncpg://...)" if scheme.startswith("postgres") else ""
        raise ValueError(
            f"database URL scheme {scheme!r} is not one Prefect's server runs on "
            f"({', '.join(DATABASE_SCHEMES)}){hint}: {mask_password(url)}"
        )
    return url


def mask_password(url: str) -> str:
    """The URL with its password replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


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
            raise ForeignServerError(
                f"{server.api_url} answers, but it is not the Prefect server of this workdir "
                f"({problem}); stop that server or pick another port (EAGLE3_PREFECT_PORT)"
            )
        running = running_database(server)
        if server.database_url and running != server.database():
            raise ForeignServerError(
                f"the server of this workdir runs on {running}, not on {server.database()}; "
                "stop it first (eagle3 server stop)"
            )
        return "reused"
    server.home.mkdir(parents=True, exist_ok=True)
    # `prefect server start` through flows.prefect_server (the prefect CLI, plus SQLITE_ENV's effect when set)
    argv = [
        sys.executable,
        "-m",
        "flows.prefect_server",
        "server",
        "start",
        "--host",
        "127.0.0.1",
        "--port",
        str(server.port),
    ]
    pid = spawn_detached(argv, server.log_file, env={**os.environ, **server.server_env()})
    write_pid_file(server.pid_file, pid)
    server.database_file.write_text(server.database() + "\n")
    _wait_healthy(server, pid, timeout_s)
    return "started"


def _wait_healthy(server: LocalServer, pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if healthy(server):
            return
        if not pid_alive(pid):
            raise RuntimeError(
                f"prefect server exited during start-up; log {server.log_file}:\n{tail(server.log_file)}"
            )
        time.sleep(1.0)
    raise TimeoutError(
        f"prefect server not healthy after {timeout_s:.0f} s; log {server.log_file}:\n{tail(server.log_file)}"
    )


def running_database(server: LocalServer) -> str:
    """The (masked) database of the server this workdir started, as recorded at its start."""
    try:
        return server.database_file.read_text().strip()
    except OSError:
        return "sqlite"


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
    return {
        "healthy": healthy(server),
        "pid": pid if pid and pid_alive(pid) else None,
        "database": running_database(server),
        "ui": server.ui_url,
        "api": server.api_url,
        "home": str(server.home),
        "log": str(server.log_file),
    }
