"""flows.local_server: a healthy listener on the port is reused only when the workdir's pid file names it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flows.local_server import (
    DATABASE_ENV,
    SQLITE_ENV,
    ForeignServerError,
    LocalServer,
    for_workdir,
    mask_password,
    owner_problem,
    start,
)
from infra.process import process_cmdline, write_pid_file


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
        deadline = time.monotonic() + 30
        # until its exec is done /proc shows the parent's command line, or none at all (a loaded machine)
        while (process_cmdline(proc.pid) or [])[-len(argv) :] != list(argv):
            assert time.monotonic() < deadline, f"pid {proc.pid} never showed {argv} in /proc"
            time.sleep(0.01)
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


PG_URL = "postgresql+asyncpg://prefect:s3cret@db.example:5432/prefect"


def test_a_database_url_reaches_the_server_process_only_and_is_shown_masked(tmp_path):
    """--database goes into the server's environment (with its port for the UI), never into the clients'."""
    server = for_workdir(tmp_path, 4311, PG_URL)
    env = server.server_env()
    assert env[DATABASE_ENV] == PG_URL and env["PREFECT_SERVER_API_PORT"] == "4311"
    assert DATABASE_ENV not in server.client_env() and "s3cret" not in str(server.client_env())
    assert server.database() == "postgresql+asyncpg://prefect:***@db.example:5432/prefect"
    assert mask_password("sqlite+aiosqlite:////tmp/x.db") == "sqlite+aiosqlite:////tmp/x.db"
    assert DATABASE_ENV not in for_workdir(tmp_path, 4311).server_env()


def test_a_database_url_without_an_async_driver_is_refused_with_the_form_it_needs(tmp_path):
    """postgresql:// (psycopg2's scheme) is refused naming postgresql+asyncpg, and the password is not printed."""
    with pytest.raises(ValueError, match=r"postgresql\+asyncpg://\.\.\.") as info:
        for_workdir(tmp_path, 4311, PG_URL.replace("+asyncpg", ""))
    assert "s3cret" not in str(info.value)


def test_our_server_on_another_database_is_not_reused_for_a_database_request(tmp_path):
    """A running server of this workdir started on SQLite is refused when PostgreSQL is asked for."""
    with _someone_elses_server() as port:
        server = for_workdir(tmp_path, port, PG_URL)
        server.home.mkdir(parents=True)
        with _process("server", "start", "--host", "127.0.0.1", "--port", str(port)) as pid:
            write_pid_file(server.pid_file, pid)
            with pytest.raises(ForeignServerError, match="runs on sqlite, not on postgresql"):
                start(server, timeout_s=1)
            server.database_file.write_text(server.database() + "\n")
            assert start(server, timeout_s=1) == "reused"


def test_the_sqlite_server_takes_the_write_lock_at_begin_and_postgres_is_left_as_it_is(tmp_path):
    """Issue 39 list 1 item 1: concurrent Run submissions while a pipeline ran got 503 `database is locked` (a
    DEFERRED transaction that read, then wrote). On SQLite the server's environment carries SQLITE_ENV, which
    flows.prefect_server turns into BEGIN IMMEDIATE; never in the clients' environment, not on PostgreSQL."""
    assert SQLITE_ENV == {"EAGLE3_SQLITE_BEGIN_IMMEDIATE": "1"}
    sqlite = for_workdir(tmp_path, 4311)
    assert sqlite.server_env().items() >= SQLITE_ENV.items()
    assert not set(SQLITE_ENV) & set(sqlite.client_env())
    assert not set(SQLITE_ENV) & set(for_workdir(tmp_path, 4311, PG_URL).server_env())
    assert not set(SQLITE_ENV) & set(LocalServer(tmp_path, 4311, sqlite_settings=False).server_env())


def test_prefect_server_begins_every_sqlite_transaction_immediate(monkeypatch):
    """flows.prefect_server.begin_immediate: what Prefect's SQLite configuration BEGINs, with or without a row lock."""
    import asyncio

    from prefect.server.database.configurations import SQLITE_BEGIN_MODE, AioSqliteConfiguration

    from flows.prefect_server import begin_immediate

    modes: list[str | None] = []

    class _Transaction:
        async def __aenter__(self):
            modes.append(SQLITE_BEGIN_MODE.get())
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

    class _Session:
        def begin(self) -> _Transaction:
            return _Transaction()

    async def begin_twice() -> None:
        config = AioSqliteConfiguration("sqlite+aiosqlite:///unused.db")
        for with_for_update in (False, True):
            async with config.begin_transaction(_Session(), with_for_update=with_for_update):
                pass

    monkeypatch.setattr(AioSqliteConfiguration, "begin_transaction", AioSqliteConfiguration.begin_transaction)
    asyncio.run(begin_twice())
    assert modes == ["DEFERRED", "IMMEDIATE"]  # Prefect's own choice: what the fix changes
    begin_immediate()
    begin_immediate()  # idempotent
    modes.clear()
    asyncio.run(begin_twice())
    assert modes == ["IMMEDIATE", "IMMEDIATE"]
