"""Retry policy for tasks whose failures can be transient I/O (never user errors)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypedDict

from prefect.tasks import exponential_backoff

TRANSIENT = (ConnectionError, TimeoutError, BlockingIOError, InterruptedError)


def only_transient(task, task_run, state) -> bool:
    """Retry I/O hiccups; a bad config or bad data fails at once with its message."""
    try:
        state.result()
    except TRANSIENT:
        return True
    except Exception:
        return False
    return True


class RetryOptions(TypedDict):
    """The @task keywords of IO_RETRY (typed, so that ``@task(**IO_RETRY)`` type-checks)."""

    retries: int
    retry_delay_seconds: Callable[[int], list[float]]
    retry_jitter_factor: float
    retry_condition_fn: Callable[[Any, Any, Any], bool]


IO_RETRY: RetryOptions = {
    "retries": 2,
    "retry_delay_seconds": exponential_backoff(backoff_factor=2),
    "retry_jitter_factor": 0.2,
    "retry_condition_fn": only_transient,
}
