"""A run that waits for a worker is Late with the reason as its state's message and a warning in its logs, on a real
local server started as `eagle3 server start` starts it (flows/local_server.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.states import Running

from flows import local_server
from flows.waiting import LOGGER_NAME
from tests.postgres import free_port


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[SyncPrefectClient]:
    """A client of a fresh local server whose runs are Late 1 s past their schedule (looked at every second)."""
    server = local_server.LocalServer(tmp_path_factory.mktemp("late") / ".prefect", free_port())
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PREFECT_SERVER_SERVICES_LATE_RUNS_AFTER_SECONDS", "1")
        env.setenv("PREFECT_SERVER_SERVICES_LATE_RUNS_LOOP_SECONDS", "1")
        local_server.start(server)
    try:
        with SyncPrefectClient(server.api_url) as api:
            yield api
    finally:
        local_server.stop(server)


def _deployment(client: SyncPrefectClient, pool: str, concurrency_limit: int | None = None):
    client.create_work_pool(WorkPoolCreate(name=pool, type="process", concurrency_limit=concurrency_limit))
    flow_id = client.create_flow_from_name(f"{pool}-flow")
    return client.create_deployment(
        flow_id=flow_id, name=pool, work_pool_name=pool, entrypoint="flows/pipeline.py:eagle3_pipeline"
    )


def _late(client: SyncPrefectClient, run_id, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = client.read_flow_run(run_id)
        if run.state and run.state.name == "Late":
            return run
        time.sleep(0.5)
    raise AssertionError(f"flow run {run_id} not Late after {timeout_s:.0f} s: {run.state}")


def _warnings(client: SyncPrefectClient, run_id) -> list[str]:
    logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
    return [log.message for log in logs if log.name == LOGGER_NAME]


def test_a_run_on_a_pool_without_worker_is_late_with_that_reason(client):
    """No worker polls the pool: the Late state's message and a warning in the run's logs say so, with the
    command that starts one."""
    run = client.create_flow_run_from_deployment(_deployment(client, "late-nobody"))
    late = _late(client, run.id)
    assert "no worker polling work pool 'late-nobody'" in late.state.message
    assert "eagle3 worker start --pool late-nobody" in late.state.message
    assert any("no worker polling work pool 'late-nobody'" in line for line in _warnings(client, run.id))


def test_a_run_behind_a_full_pool_is_late_naming_the_run_that_holds_it(client):
    """An online worker, but the pool's concurrency limit 1 is held by a Running run: the message names the limit
    and that run."""
    deployment_id = _deployment(client, "late-full", concurrency_limit=1)
    client.send_worker_heartbeat("late-full", "worker-a", heartbeat_interval_seconds=60)
    holder = client.create_flow_run_from_deployment(deployment_id, name="holder-run")
    client.set_flow_run_state(holder.id, Running(), force=True)
    run = client.create_flow_run_from_deployment(deployment_id)
    late = _late(client, run.id)
    assert "work pool 'late-full': concurrency limit 1 reached by run 'holder-run' (Running)" in late.state.message
    assert "no worker" not in late.state.message


def test_a_run_behind_a_busy_worker_is_late_naming_the_worker_and_its_run(client):
    """No limit on the pool, its one online worker busy with a Running run: the message names both."""
    deployment_id = _deployment(client, "late-busy")
    client.send_worker_heartbeat("late-busy", "worker-b", heartbeat_interval_seconds=60)
    holder = client.create_flow_run_from_deployment(deployment_id, name="busy-run")
    client.set_flow_run_state(holder.id, Running(), force=True)
    run = client.create_flow_run_from_deployment(deployment_id)
    late = _late(client, run.id)
    assert "work pool 'late-busy': its online worker worker-b busy with run 'busy-run' (Running)" in late.state.message
