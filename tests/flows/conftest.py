"""One Prefect test server for every flow test in the session: temporary SQLite (prefect_test_harness), or a
throw-away PostgreSQL cluster with EAGLE3_TEST_DATABASE=postgres (the whole flow suite on PostgreSQL)."""

from __future__ import annotations

import pytest

from tests.postgres import flow_tests_database, prefect_on_postgres


@pytest.fixture(autouse=True, scope="session")
def prefect_harness(tmp_path_factory):
    """Start the session's server once (its start-up, ~20 s here, dominates flow-test time); yields its PostgreSQL
    cluster, or None on SQLite."""
    import os

    os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(tmp_path_factory.mktemp("prefect-results"))
    if flow_tests_database() == "postgres":
        with prefect_on_postgres(tmp_path_factory.mktemp("prefect-server") / ".prefect") as pg:
            yield pg
        return
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield None
