"""One Prefect test server (temporary SQLite) for every flow test in the session."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def prefect_harness(tmp_path_factory):
    """Start prefect_test_harness once; its start-up (~20 s here) dominates flow-test time."""
    import os

    os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(tmp_path_factory.mktemp("prefect-results"))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield
