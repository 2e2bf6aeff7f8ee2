"""Tasks that end Cancelled, not Crashed, when their flow run is cancelled.

Prefect cancels a flow run by SIGTERMing its process (the runner or worker does, after the run turned
Cancelling); the flow engine turns the signal into a ``TerminationSignal`` raised wherever the main thread is,
and the task engine reports every ``TerminationSignal`` that crosses a task as Crashed. A task made with
``cancellable`` catches it once its own cleanup ran (for training, infra.torchrun has stopped torchrun and every
rank by then), returns a Cancelled state when the flow run is being cancelled, so the task run ends Cancelled,
and raises the signal again right after the task engine is done, so the flow engine still ends the flow run as
cancelled. Any other termination (a plain SIGTERM, a host shutting down) stays a crash.
"""

from __future__ import annotations

import functools
import signal
from typing import Any, cast
from uuid import UUID

from prefect import Task, get_run_logger
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled, State


def flow_run_cancelling() -> bool:
    """True when the current flow run is being cancelled (its state on the server is Cancelling or Cancelled)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(UUID(str(flow_run.id))).state
    except Exception:  # noqa: BLE001 - no server, no flow run: not a cancellation we can prove
        return False
    return state is not None and (state.is_cancelling() or state.is_cancelled())


class CancellableTask(Task):
    """A Task whose function answers a cancellation with a Cancelled state (see ``cancellable``): after the task
    engine has recorded it, the call raises the TerminationSignal again for the flow engine."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = super().__call__(*args, **kwargs)
        if isinstance(out, State) and out.is_cancelled():  # return_state=True, or the function's own return
            raise TerminationSignal(signal.SIGTERM)
        return out

    def with_options(self, *args: Any, **kwargs: Any) -> CancellableTask:
        new = super().with_options(*args, **kwargs)
        new.__class__ = CancellableTask
        return cast(CancellableTask, new)  # (its class, just set)


def cancellable(task: Task) -> CancellableTask:
    """``task`` (defined with @task as usual) as a CancellableTask: a TerminationSignal that reaches its function
    while the flow run is being cancelled ends the task run Cancelled, never Crashed, and stores no cache record."""
    fn = task.fn

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except TerminationSignal:
            if not flow_run_cancelling():
                raise
            from prefect.transactions import get_transaction

            transaction = get_transaction()
            if transaction is not None:
                transaction.write_on_commit = False
            message = f"flow run cancelled: {task.name} stopped its processes"
            get_run_logger().warning(message)
            return Cancelled(message=message)

    new = task.with_options()
    new.__class__ = CancellableTask
    new.fn = run
    return cast(CancellableTask, new)  # (its class, just set)
