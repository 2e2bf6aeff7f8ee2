"""Why a flow run did not complete, read back from the Prefect API: the failed task, its exception, the log's end.

`eagle3 demo`, `eagle3 run` and follow() print this where the user is looking (the terminal) instead of
leaving the reason in a worker log: the failed task runs of the run and of its subflows, the exception
type and message from their state, and the last lines of the logs the runs sent to the API.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any
from uuid import UUID

LOG_TAIL_LINES = 25
_EXCEPTION_PREFIX = re.compile(r"^(Task|Flow) run encountered an exception:?\s*")


@dataclass(frozen=True)
class FailureReport:
    """What went wrong in one flow run (and its subflows)."""

    run_name: str
    state: str
    failed_tasks: list[str]
    error: str
    log_tail: list[str]

    def lines(self, full_log: str | None = None) -> list[str]:
        """The report as terminal lines; ``full_log`` names where the complete log is."""
        out = [f"flow run {self.run_name}: {self.state}"]
        if self.failed_tasks:
            out.append(f"  failed task: {', '.join(self.failed_tasks)}")
        out.append(f"  error: {self.error or '(no message)'}")
        if self.log_tail:
            out += [f"  last {len(self.log_tail)} log lines:"] + [f"    {line}" for line in self.log_tail]
        if full_log:
            out.append(f"  full log: {full_log}")
        return out


def state_error(message: str | None) -> str:
    """'ValueError: accelerate is required ...' from a Failed state's message (Prefect's prefix removed)."""
    return _EXCEPTION_PREFIX.sub("", (message or "").strip())


def _failed_tasks(client: Any, run_ids: list[UUID]) -> list[Any]:
    """Failed or crashed task runs of these flow runs, earliest end first (the first is the root cause)."""
    from prefect.client.schemas.filters import (
        TaskRunFilter,
        TaskRunFilterFlowRunId,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    runs = client.read_task_runs(
        task_run_filter=TaskRunFilter(
            flow_run_id=TaskRunFilterFlowRunId(any_=run_ids),
            state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.FAILED, StateType.CRASHED])),
        )
    )
    return sorted(runs, key=lambda r: r.end_time or r.updated or r.created)


def log_tail(client: Any, run_ids: list[UUID], num_lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last ``num_lines`` lines of the logs these flow runs (and their tasks) sent to the API."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    logs = client.read_logs(
        log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=run_ids)), sort=LogSort.TIMESTAMP_DESC, limit=200
    )
    lines: list[str] = []
    for log in reversed(logs):
        head = f"{log.timestamp:%H:%M:%S} {logging.getLevelName(log.level):<7} "
        lines += [head + text if i == 0 else text for i, text in enumerate(log.message.splitlines())]
    return lines[-num_lines:]


def explain_run(client: Any, flow_run: Any, run_ids: list[UUID], wait_s: float = 5.0) -> FailureReport:
    """The FailureReport of a terminal, not completed flow run; ``run_ids`` = it and its subflow runs.

    Task states and logs reach the API slightly after the flow run's own state, so this waits up to
    ``wait_s`` for a failed task to appear when the flow run failed with an exception.
    """
    deadline = time.monotonic() + wait_s
    tasks = _failed_tasks(client, run_ids)
    while not tasks and flow_run.state.is_failed() and time.monotonic() < deadline:
        time.sleep(0.5)
        tasks = _failed_tasks(client, run_ids)
    error = state_error(tasks[0].state.message) if tasks else state_error(flow_run.state.message)
    return FailureReport(
        run_name=flow_run.name,
        state=flow_run.state.name,
        failed_tasks=[t.name for t in tasks],
        error=error,
        log_tail=log_tail(client, run_ids),
    )


def write_full_log(client: Any, run_ids: list[UUID], path: Any, page: int = 200) -> None:
    """Every log line these flow runs sent to the API, oldest first, into ``path`` (a pathlib.Path)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        offset = 0
        while True:
            logs = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=run_ids)),
                sort=LogSort.TIMESTAMP_ASC,
                limit=page,
                offset=offset,
            )
            for log in logs:
                fh.write(f"{log.timestamp:%Y-%m-%d %H:%M:%S} {logging.getLevelName(log.level):<7} {log.message}\n")
            if len(logs) < page:
                return
            offset += page
