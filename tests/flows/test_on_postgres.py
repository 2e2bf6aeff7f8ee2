"""A representative few of the flow tests again, in the default suite, against a Prefect server on a throw-away
PostgreSQL cluster (the rest of the session's flow tests use SQLite): flow and task runs with the stage cache, a
failed task read back through filters, the run-summary artifact, work pools, concurrency limits and automations.
A deployment run by a worker (~30 s) is left to the whole flow suite on PostgreSQL, EAGLE3_TEST_DATABASE=postgres
(then this module reuses the session's server)."""

from __future__ import annotations

import pytest
from prefect import flow
from prefect.client.orchestration import get_client

from tests.flows.test_failed_run import failed_state, test_failed_pipeline_writes_a_run_summary_naming_stage_and_error
from tests.flows.test_pipeline_flow import (
    test_flow_completes_and_writes_every_output,
    test_merge_keeping_no_rows_fails_its_task_with_the_reason,
    test_second_run_with_same_inputs_recomputes_nothing,
    workdir,
)
from tests.flows.test_setup import test_setup_twice_gives_one_of_each
from tests.postgres import prefect_on_postgres

pytestmark = pytest.mark.postgres

RERUN = (
    failed_state,
    workdir,
    test_failed_pipeline_writes_a_run_summary_naming_stage_and_error,
    test_flow_completes_and_writes_every_output,
    test_merge_keeping_no_rows_fails_its_task_with_the_reason,
    test_second_run_with_same_inputs_recomputes_nothing,
    test_setup_twice_gives_one_of_each,
)  # collected here again


@pytest.fixture(autouse=True, scope="module")
def postgres(prefect_harness, tmp_path_factory):
    """The session's cluster when the session already runs on PostgreSQL; else a server on a new one, for this
    module only (the session's SQLite server comes back after it)."""
    if prefect_harness is not None:
        yield prefect_harness
        return
    with prefect_on_postgres(tmp_path_factory.mktemp("prefect-pg-server") / ".prefect") as pg:
        yield pg


@flow(name="postgres-probe")
def _probe(value: int) -> int:
    return value + 1


def test_a_flow_run_is_a_row_of_postgresql(postgres):
    """A flow run completes through the server and is the same row, Completed, in PostgreSQL's flow_run table."""
    state = _probe(41, return_state=True)
    assert state.result() == 42
    run_id = str(state.state_details.flow_run_id)
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(run_id).state.type.value == "COMPLETED"
    assert postgres.psql(
        f"select r.state_type, f.name from flow_run r join flow f on f.id = r.flow_id where r.id = '{run_id}'"
    ) == [["COMPLETED", "postgres-probe"]]
