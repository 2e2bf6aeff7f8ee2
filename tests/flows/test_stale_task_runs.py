"""After the automatic retry of a killed flow run, the killed attempt's task runs no longer show "Running" forever
(issue 39, first list, item 5): the next attempt's first step (guard_crash_loop) marks them Crashed."""

from __future__ import annotations

from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.flow_engine import run_flow
from prefect.states import AwaitingRetry, Completed, Crashed, Running

from flows.common import guard_crash_loop


@task
def killed_step() -> None:
    """Stands for the task the killed attempt was running (never called: created through the API)."""


@task
def finished_step() -> None:
    """Stands for a task the killed attempt had finished."""


@flow(name="eagle3-test-retried-attempt")
def retried_attempt() -> int:
    guard_crash_loop()
    from prefect.runtime import flow_run

    return flow_run.run_count


def test_the_retried_attempt_marks_the_killed_attempts_running_tasks_crashed():
    """Attempt 1 died with one task Running and one Completed (the worker's process SIGKILLed, the run then Crashed
    and put back in AwaitingRetry by the retry automation); attempt 2, started on the same flow run, ends the
    Running one as Crashed and leaves the Completed one as it was, and a subflow's stand-in task run to the
    subflow run the engine re-attaches to it."""
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(retried_attempt, parameters={})
        client.set_flow_run_state(run.id, Running(), force=True)
        stuck = client.create_task_run(killed_step, flow_run_id=run.id, dynamic_key="0", state=Running())
        done = client.create_task_run(finished_step, flow_run_id=run.id, dynamic_key="0", state=Completed())
        stand_in = client.create_task_run(killed_step, flow_run_id=run.id, dynamic_key="1", state=Running())
        client.create_flow_run(retried_attempt, parameters={}, parent_task_run_id=stand_in.id)  # a subflow's
        client.set_task_run_state(stand_in.id, Running(), force=True)
        client.set_flow_run_state(run.id, Crashed(message="process killed"), force=True)
        client.set_flow_run_state(run.id, AwaitingRetry(), force=True)
        assert client.read_task_run(stuck.id).state.type == StateType.RUNNING
        state = run_flow(retried_attempt, flow_run=client.read_flow_run(run.id), return_type="state")
        assert state.is_completed() and state.result() == 2
        after = client.read_task_run(stuck.id).state
        assert after.type == StateType.CRASHED and "attempt 2" in after.message
        assert client.read_task_run(done.id).state.type == StateType.COMPLETED
        assert client.read_task_run(stand_in.id).state.type == StateType.RUNNING  # left to its subflow run
