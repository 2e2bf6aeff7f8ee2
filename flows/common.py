"""Flow runs of a deployment, submitted without waiting and then polled: the fan-out that multi-node training
(flows/train_nodes.py) and sliced capture (flows/capture.py) share.

`run_deployment(..., timeout=0)` returns as soon as the run is scheduled, so a parent can hand N runs to N
workers at once; the parent then polls their states (a flow run's state lives on the server, so a run whose
worker died ends Crashed there, marked by the heartbeat automation) and decides what to submit again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any
from uuid import UUID

from pydantic import BaseModel


def submit_run(deployment: str, parameters: dict[str, Any], name: str) -> UUID:
    """Schedule one flow run of ``deployment`` (a subflow of the calling flow) and return its id at once."""
    from prefect.deployments import run_deployment

    params = {k: json.loads(v.model_dump_json()) if isinstance(v, BaseModel) else v for k, v in parameters.items()}
    run = run_deployment(deployment, parameters=params, timeout=0, as_subflow=True, flow_run_name=name)
    return run.id


def wait_runs(ids: list[UUID], poll_s: float, deadline_s: float,
              on_poll: Callable[[], None] | None = None) -> list[str]:
    """Poll until every flow run is final; their state types, in order (TIMEOUT for any still open at the end).

    ``on_poll`` runs after each look (e.g. to refresh a progress artifact from what is on disk)."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + deadline_s
    with get_client(sync_client=True) as client:
        while True:
            states = [client.read_flow_run(i).state for i in ids]
            if on_poll is not None:
                on_poll()
            if all(s is not None and s.is_final() for s in states) or time.monotonic() > deadline:
                return [s.type.value if s is not None and s.is_final() else "TIMEOUT" for s in states]
            time.sleep(poll_s)
