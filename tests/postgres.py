"""A throw-away PostgreSQL cluster (scripts/postgres.sh) and a Prefect server on it, for the tests that run on
PostgreSQL. No PostgreSQL server binaries is a test failure that says how to get them, never a skip: a test that
skips wherever PostgreSQL is missing would check nothing on the machines that lack it (CI's test command installs
it: scripts/postgres.sh install)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "scripts" / "postgres.sh")
DATABASE_ENV = "EAGLE3_TEST_DATABASE"  # sqlite (default) | postgres: the database of the flow tests' server


@dataclass(frozen=True)
class Postgres:
    """A running throw-away cluster: its URL, its binaries and the environment that names it."""

    url: str
    bin_dir: Path
    env: dict[str, str]
    port: int

    def psql(self, sql: str) -> list[list[str]]:
        """Rows of a query on the `prefect` database, each a list of column texts."""
        out = subprocess.run(
            [
                str(self.bin_dir / "psql"),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                "prefect",
                "prefect",
                "-Atc",
                sql,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return [line.split("|") for line in out.splitlines()]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def flow_tests_database() -> str:
    """The database the flow tests' session server runs on, from EAGLE3_TEST_DATABASE (default sqlite)."""
    name = os.environ.get(DATABASE_ENV, "sqlite")
    if name not in ("sqlite", "postgres"):
        raise pytest.UsageError(f"{DATABASE_ENV}={name!r}: expected sqlite or postgres")
    return name


def server_binaries() -> Path:
    """The folder of initdb/pg_ctl/psql; fails the test (never skips) when there is none."""
    found = subprocess.run([SCRIPT, "bin"], capture_output=True, text=True)
    if found.returncode != 0:
        pytest.fail(
            f"this test needs PostgreSQL and there is none: {found.stderr.strip()}. `scripts/postgres.sh "
            "install` (what ./scripts/test.sh runs) installs it as root; deselect with -m 'not postgres'",
            pytrace=False,
        )
    return Path(found.stdout.strip())


@contextmanager
def postgres_cluster() -> Iterator[Postgres]:
    """scripts/postgres.sh start in a temp folder on a free port; stopped and removed afterwards."""
    bin_dir = server_binaries()
    folder = Path(tempfile.mkdtemp(prefix="eagle3-pg-"))
    folder.chmod(0o755)  # as root the cluster runs as `postgres`, which must be able to enter the folder
    port = free_port()
    env = {**os.environ, "EAGLE3_PG_DIR": str(folder / "pg"), "EAGLE3_PG_PORT": str(port)}
    try:
        started = subprocess.run([SCRIPT, "start"], env=env, capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stderr
        yield Postgres(started.stdout.strip(), bin_dir, env, port)
    finally:
        subprocess.run([SCRIPT, "stop"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def prefect_on_postgres(home: Path) -> Iterator[Postgres]:
    """A Prefect server on a new cluster, started the way `eagle3 server start --database URL` starts it, with this
    process's Prefect settings pointed at it (as prefect_test_harness does for its SQLite server)."""
    from flows import local_server

    with postgres_cluster() as pg:
        server = local_server.LocalServer(home, free_port(), pg.url)
        try:
            local_server.start(server)
            _drain_prefect_workers()  # queued for the previous server; the next event starts a worker for this one
            with _api_url(server.api_url):
                try:
                    yield pg
                finally:
                    _drain_prefect_workers()
        finally:
            local_server.stop(server)


@contextmanager
def _api_url(url: str) -> Iterator[None]:
    """This process's Prefect client settings point at ``url``: in this context and, as prefect_test_harness also
    does (prefect/testing/utilities.py), in the process-global one, which threads that did not copy this context
    read (a progress thread of the train task does: without it, its updates go to an ephemeral server)."""
    import prefect.context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with (
        temporary_settings(updates={PREFECT_API_URL: url}),
        prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()),
    ):
        yield


def _drain_prefect_workers() -> None:
    """Send the queued logs and events to the server they were meant for and stop their workers, as
    prefect_test_harness does before it stops its server. Prefect keeps one events worker per process, bound to the
    API URL of its first event: without this, the events (and so the task runs, which Prefect records from events)
    of flows run after a change of server go to the previous one, and logs queued for a stopped server keep the
    next drain retrying for about a minute."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(at_exit=False)  # every instance there is (instance() would start one), waiting for each
