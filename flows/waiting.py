"""Why a flow run waits: a run that has not started after its scheduled time is Late with the reason as its state's
message, and every change of reason is a warning line in the run's logs.

Prefect's own late-runs service marks such a run Late with no message, though the server knows why it waits: its
work pool is paused or has no online worker, the pool's, queue's or deployment's concurrency limit is reached (and
by which runs), or every online worker is busy. ``wait_reasons`` reads those facts through the client;
``LateRunWatcher`` is the late-runs service that names them. The local server runs it in its own process
(flows/prefect_server.py, with Prefect's service off: one writer of Late, same `after_seconds` setting); for a
server started otherwise, `python -m flows.waiting` runs it beside the server. The follow view (flows/follow.py)
prints the same reasons.

Late is proposed through Prefect's orchestration, never forced: its rule accepts it only from a Scheduled state, so
a run a worker took in the meantime stays Pending. A Late state cannot be re-entered with a new message (the same
rule refuses Late -> Late); a later change of reason goes to the run's logs.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any
from uuid import UUID

LOGGER_NAME = "eagle3.waiting"
"""The logger name of the lines this module writes into a waiting run's logs."""
BUSY_STATES = ("PENDING", "RUNNING", "CANCELLING")
"""Flow-run state types that hold a worker, a pool's or a deployment's concurrency slot."""
MAX_NAMED = 3
"""Runs named in one reason; more are counted."""


def no_worker_text(pool: str) -> str:
    """The reason for a pool without an online worker, with the commands that start one."""
    return (
        f"no worker polling work pool '{pool}': start one with `eagle3 worker start --pool {pool}` here, "
        f"or `prefect worker start --pool {pool}` on a host of that pool"
    )


def _named(runs: list[Any]) -> str:
    shown = ", ".join(f"'{r.name}' ({r.state.name if r.state else '?'})" for r in runs[:MAX_NAMED])
    more = f" and {len(runs) - MAX_NAMED} more" if len(runs) > MAX_NAMED else ""
    return f"run{'s' if len(runs) > 1 else ''} {shown}{more}"


def _busy_runs(client: Any, exclude: UUID, **filters: Any) -> list[Any]:
    """Flow runs holding a slot (Pending, Running, Cancelling) that match ``filters`` (read_flow_runs filters)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType

    busy = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=list(BUSY_STATES))))
    return [r for r in client.read_flow_runs(flow_run_filter=busy, **filters) if r.id != exclude]


def _pool_reasons(client: Any, run: Any, pool: Any) -> list[str]:
    """What of the run's work pool and queue keeps it from starting (paused, no worker, limits reached)."""
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName, WorkQueueFilter, WorkQueueFilterName
    from prefect.client.schemas.objects import WorkerStatus
    from prefect.exceptions import ObjectNotFound

    reasons = [f"work pool '{pool.name}' is paused (resume it on the Work Pools page)"] if pool.is_paused else []
    if not any(w.status == WorkerStatus.ONLINE for w in client.read_workers_for_work_pool(pool.name)):
        reasons.append(no_worker_text(pool.name))
    in_pool = WorkPoolFilter(name=WorkPoolFilterName(any_=[pool.name]))
    holders = _busy_runs(client, run.id, work_pool_filter=in_pool)
    if pool.concurrency_limit is not None and len(holders) >= pool.concurrency_limit:
        reasons.append(
            f"work pool '{pool.name}': concurrency limit {pool.concurrency_limit} reached by {_named(holders)}"
        )
    try:
        queue = client.read_work_queue_by_name(run.work_queue_name, work_pool_name=pool.name)
    except ObjectNotFound:
        return reasons
    if queue.is_paused:
        reasons.append(f"work queue '{queue.name}' of pool '{pool.name}' is paused")
    if queue.concurrency_limit is not None:
        in_queue = _busy_runs(
            client,
            run.id,
            work_pool_filter=in_pool,
            work_queue_filter=WorkQueueFilter(name=WorkQueueFilterName(any_=[queue.name])),
        )
        if len(in_queue) >= queue.concurrency_limit:
            reasons.append(
                f"work queue '{queue.name}' of pool '{pool.name}': concurrency limit "
                f"{queue.concurrency_limit} reached by {_named(in_queue)}"
            )
    return reasons


def _deployment_reasons(client: Any, run: Any) -> list[str]:
    """The deployment's concurrency limit, when it is reached (and by which runs)."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    if run.deployment_id is None:
        return []
    deployment = client.read_deployment(run.deployment_id)
    limit = deployment.global_concurrency_limit
    if limit is None or not limit.active or limit.active_slots < limit.limit:
        return []
    holders = _busy_runs(
        client, run.id, deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[run.deployment_id]))
    )
    return [
        f"deployment '{deployment.name}': concurrency limit {limit.limit} reached by "
        + (_named(holders) if holders else f"{limit.active_slots} run(s)")
    ]


def wait_reasons(client: Any, run: Any) -> list[str]:
    """Why ``run`` (a flow run of a work pool, not started) has not started, most specific facts first; [] for a
    run of no work pool (it runs where it was called)."""
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName
    from prefect.client.schemas.objects import WorkerStatus
    from prefect.exceptions import ObjectNotFound

    if not run.work_pool_name:
        return []
    try:
        pool = client.read_work_pool(run.work_pool_name)
    except ObjectNotFound:
        return [f"work pool '{run.work_pool_name}' does not exist (`eagle3 setup` creates the project's pools)"]
    reasons = _pool_reasons(client, run, pool) + _deployment_reasons(client, run)
    if reasons:
        return reasons
    online = [w.name for w in client.read_workers_for_work_pool(pool.name) if w.status == WorkerStatus.ONLINE]
    busy = _busy_runs(client, run.id, work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool.name])))
    if busy:
        return [
            f"work pool '{pool.name}': its online worker{'s' if len(online) > 1 else ''} "
            f"{', '.join(online)} busy with {_named(busy)} (a worker started with --limit N runs N flow runs "
            "at a time)"
        ]
    return [
        f"work pool '{pool.name}' has online worker{'s' if len(online) > 1 else ''} {', '.join(online)}; "
        "none has taken the run yet"
    ]


def wait_reason(client: Any, run: Any) -> str:
    """``wait_reasons`` as one line ('' for none)."""
    return "; ".join(wait_reasons(client, run))


def mark_late(client: Any, run: Any, reason: str) -> bool:
    """Propose Late with ``reason`` as its message (same scheduled time); True when accepted. Prefect's rule
    accepts it only from a Scheduled state that is not Late already, so a run taken by a worker meanwhile is
    left alone."""
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.states import Late

    state: Any = Late(scheduled_time=run.next_scheduled_start_time, message=f"Waits for: {reason}")
    return client.set_flow_run_state(run.id, state).status == SetStateStatus.ACCEPT


def log_to_run(client: Any, run_id: UUID, text: str) -> None:
    """One warning line in the run's logs (its page's Logs tab)."""
    from prefect.client.schemas.actions import LogCreate

    client.create_logs(
        [
            LogCreate(
                name=LOGGER_NAME,
                level=logging.WARNING,
                message=text,
                timestamp=datetime.now(timezone.utc),
                flow_run_id=run_id,
            )
        ]
    )


def overdue_runs(client: Any, after_s: float) -> list[Any]:
    """Flow runs of a work pool still in a Scheduled-type state ``after_s`` past their scheduled start."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterNextScheduledStartTime,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )

    before = datetime.now(timezone.utc) - timedelta(seconds=after_s)
    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["SCHEDULED"])),
            next_scheduled_start_time=FlowRunFilterNextScheduledStartTime(before_=before),
        ),
        limit=200,
    )
    return [r for r in runs if r.work_pool_name]


@dataclass
class LateRunWatcher:
    """Marks overdue Scheduled runs Late with their reason, and logs each later change of reason to the run."""

    after_s: float
    reported: dict[UUID, str] = field(default_factory=dict)

    def pass_once(self, client: Any) -> dict[UUID, str]:
        """One look at every overdue run; returns {run id: reason} of the runs it wrote to."""
        wrote, waiting = {}, overdue_runs(client, self.after_s)
        for run in waiting:
            reason = wait_reason(client, run)
            if not reason or self.reported.get(run.id) == reason:
                continue
            if run.state.name == "Scheduled":
                mark_late(client, run, reason)
            log_to_run(client, run.id, f"Flow run {run.name} waits ({run.state.name}): {reason}")
            self.reported[run.id] = wrote[run.id] = reason
        self.reported = {k: v for k, v in self.reported.items() if k in {r.id for r in waiting}}
        return wrote

    def watch(self, stop: threading.Event, every_s: float) -> None:
        """``pass_once`` every ``every_s`` until ``stop``; an API error (a server starting up) waits for the next."""
        from prefect.client.orchestration import get_client

        last_error = ""
        while not stop.is_set():
            try:
                with get_client(sync_client=True) as client:
                    self.pass_once(client)
                last_error = ""
            except Exception as exc:  # the server may not answer yet, or be restarting: try again next time
                if str(exc) != last_error:
                    print(f"eagle3 late-runs watcher: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                last_error = str(exc)
            stop.wait(every_s)


def late_settings() -> tuple[float, float]:
    """Prefect's late-runs settings: (seconds past schedule before a run is Late, seconds between looks)."""
    from prefect.settings.context import get_current_settings

    late = get_current_settings().server.services.late_runs
    return late.after_seconds.total_seconds(), float(late.loop_seconds)


def start_watcher_thread() -> threading.Thread:
    """The watcher in a daemon thread of this process, with Prefect's late-runs settings."""
    after_s, every_s = late_settings()
    thread = threading.Thread(
        target=LateRunWatcher(after_s).watch, args=(threading.Event(), every_s), daemon=True, name="eagle3-late-runs"
    )
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> None:
    """python -m flows.waiting [--once]: the watcher beside a server (start that server with --no-late-runs)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--once", action="store_true", help="one look, print what was written, exit")
    args = parser.parse_args(argv)
    after_s, every_s = late_settings()
    watcher = LateRunWatcher(after_s)
    if args.once:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            for run_id, reason in watcher.pass_once(client).items():
                print(f"{run_id}: {reason}")
        return
    watcher.watch(threading.Event(), every_s)


if __name__ == "__main__":
    main()
