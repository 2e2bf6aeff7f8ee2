"""Fake slice runs for the fan-out parents (flows.common.run_slices): submit and wait replaced in-process.

A submitted "run" is remembered; waiting on it ends it ``outcome(run name)`` and, only when that is COMPLETED,
does the slice's work in this process (``work(parameters)``). No worker, no deployment: the parent's own
re-submission, refusal and finalize logic runs unchanged against a real Prefect server.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import flows.common as common


def fake_slice_runs(
    monkeypatch: Any,
    deployment: str,
    outcome: Callable[[str], str],
    work: Callable[[dict[str, Any]], Any],
    record: Callable[[dict[str, Any]], Any],
) -> list[tuple]:
    """Patch flows.common's submit/wait; returns the submitted (run name, ``record(parameters)``) in order."""
    submitted: list[tuple] = []
    runs: dict[uuid.UUID, tuple[str, dict[str, Any]]] = {}

    def submit(name_of_deployment: str, parameters: dict[str, Any], name: str) -> uuid.UUID:
        assert name_of_deployment == deployment
        submitted.append((name, record(parameters)))
        runs[run_id := uuid.uuid4()] = (name, parameters)
        return run_id

    def wait(ids, poll_s, deadline_s, on_poll=None):
        states = []
        for run_id in ids:
            name, parameters = runs[run_id]
            states.append(outcome(name))
            if states[-1] == "COMPLETED":
                work(parameters)
        on_poll()
        return states

    monkeypatch.setattr(common, "submit_run", submit)
    monkeypatch.setattr(common, "wait_runs", wait)
    return submitted
