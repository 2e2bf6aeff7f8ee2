"""`python -m flows.prefect_server server start ...`: the `prefect` CLI, with SQLite write transactions that take the
write lock when they begin, and with flows.waiting's late-runs watcher in the server process when
EAGLE3_LATE_RUNS_WATCHER=1 (flows.local_server starts the local server this way).

Why (issue 39, list 1, item 1): Prefect's server opens its SQLite transactions with `BEGIN DEFERRED` unless the
code asks for a row lock, so `POST /deployments/{id}/create_flow_run` (the UI's Run form) reads the deployment
first and only then INSERTs the flow run. When another connection wrote in between (another submission, the
running pipeline's task runs, logs and events), SQLite cannot upgrade that read transaction to a write one without
breaking its snapshot: it answers SQLITE_BUSY at once, `database is locked`, without waiting on PRAGMA
busy_timeout (60 s), and Prefect answers 503. No Prefect setting changes the BEGIN mode
(PREFECT_SERVER_DATABASE_TIMEOUT and the services' loop settings were measured: still 503s). With
EAGLE3_SQLITE_BEGIN_IMMEDIATE=1 in the environment (flows.local_server.SQLITE_ENV sets it), every transaction
Prefect begins on SQLite is `BEGIN IMMEDIATE`, as Prefect already does for its row-locking transactions: a writer
waits for the lock (up to busy_timeout) at its BEGIN instead of failing at its first write. Reads outside a
transaction are unchanged, and PostgreSQL is untouched (another configuration class).
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager

BEGIN_IMMEDIATE_ENV = "EAGLE3_SQLITE_BEGIN_IMMEDIATE"
LATE_RUNS_ENV = "EAGLE3_LATE_RUNS_WATCHER"
"""=1: the server process also runs flows.waiting's late-runs watcher (Late with its reason as the message)."""


def begin_immediate() -> None:
    """Every transaction Prefect's server begins on SQLite takes the write lock at BEGIN (IMMEDIATE)."""
    from prefect.server.database.configurations import AioSqliteConfiguration

    deferred_or_immediate = AioSqliteConfiguration.begin_transaction
    if getattr(deferred_or_immediate, "eagle3_immediate", False):
        return

    @asynccontextmanager
    async def begin_transaction(self, session, with_for_update: bool = False) -> AsyncGenerator:
        async with deferred_or_immediate(self, session, with_for_update=True) as transaction:
            yield transaction

    begin_transaction.eagle3_immediate = True  # type: ignore[attr-defined]
    AioSqliteConfiguration.begin_transaction = begin_transaction  # type: ignore[method-assign]


def main() -> None:
    if os.environ.get(BEGIN_IMMEDIATE_ENV) == "1":
        begin_immediate()
    if os.environ.get(LATE_RUNS_ENV) == "1" and sys.argv[1:3] == ["server", "start"]:
        from flows.waiting import start_watcher_thread

        start_watcher_thread()  # a daemon thread: it asks this server's API once it answers, and ends with it
    from prefect.cli import app

    sys.argv[0] = "prefect"
    app()  # (exits itself, or returns None: exit code 0)
    sys.exit()


if __name__ == "__main__":
    main()
