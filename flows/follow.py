"""Register deployments, trigger a run through a worker, and follow it live on the terminal.

What `eagle3 demo` and the chaos script do on the client side: `prefect deploy` from prefect.yaml,
`run_deployment` without waiting, then poll the server: task runs that finish are printed as lines
and every progress artifact of the run (and of its subflows) is drawn as a progress bar. A run that
has not started is explained (what it waits for: flows/waiting.py), and a run that ends Failed or
Crashed is explained: failed task, exception, last log lines (flows/failure.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from uuid import UUID

from flows.failure import explain_run, write_full_log
from flows.local_server import LocalServer

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def deploy(server: LocalServer, names: list[str], cwd: Path) -> None:
    """`prefect --no-prompt deploy --name ...` from prefect.yaml (idempotent: updates in place)."""
    prefect = str(Path(sys.executable).with_name("prefect"))
    argv = [prefect, "--no-prompt", "deploy"] + [a for n in names for a in ("--name", n)]
    proc = subprocess.run(
        argv, cwd=cwd, env={**os.environ, **server.client_env()}, capture_output=True, text=True, timeout=600
    )
    if proc.returncode:
        raise RuntimeError(f"prefect deploy failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def deployment_pools(cwd: Path) -> dict[str, str]:
    """{deployment name: work pool name} of every deployment in ``cwd``/prefect.yaml, in file order."""
    import yaml

    doc = yaml.safe_load((cwd / "prefect.yaml").read_text())
    return {d["name"]: d["work_pool"]["name"] for d in doc["deployments"]}


def trigger(deployment: str, parameters: dict[str, Any]) -> UUID:
    """Create a run of ``deployment`` ('flow-name/deployment-name') for a worker to pick up; its id."""
    from prefect.deployments import run_deployment

    run = run_deployment(deployment, parameters=parameters, timeout=0, as_subflow=False)
    return cast("FlowRun", run).id  # (a sync call: Prefect's sync_compatible returns the run itself)


@dataclass
class RunView:
    """What has been shown of a flow run so far."""

    root: UUID
    flow_runs: set[UUID] = field(default_factory=set)
    task_states: dict[UUID, str] = field(default_factory=dict)
    bars: dict[str, Any] = field(default_factory=dict)
    crashed_at: float | None = None
    waiting_since: float | None = None
    wait_reason: str = ""


def flow_run_tree(client: Any, view: RunView) -> list[Any]:
    """The root run and its subflow runs (any depth)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[view.root])))
    frontier = [view.root]
    while frontier:
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=frontier))
        )
        children = [c for c in children if c.id not in {r.id for r in runs}]
        runs += children
        frontier = [c.id for c in children]
    view.flow_runs = {r.id for r in runs}
    return runs


def _print_task_changes(client: Any, view: RunView, say: Callable[[str], None]) -> None:
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    runs = client.read_task_runs(
        task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=list(view.flow_runs)))
    )
    for run in sorted(runs, key=lambda r: r.expected_start_time or r.created):
        state = run.state.name if run.state else "?"
        if view.task_states.get(run.id) != state and run.state and run.state.type.value in TERMINAL | {"RUNNING"}:
            took = f" ({run.total_run_time.total_seconds():.1f} s)" if run.state.type.value in TERMINAL else ""
            say(f"  {time.strftime('%H:%M:%S')}  {run.name:<40} {state}{took}")
        view.task_states[run.id] = state


def _update_bars(client: Any, view: RunView, progress: Any) -> None:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    arts = client.read_artifacts(
        artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=list(view.flow_runs)), type=ArtifactFilterType(any_=["progress"])
        )
    )
    for art in arts:
        key = art.key or str(art.id)
        if key not in view.bars:
            view.bars[key] = progress.add_task(key, total=100.0)
        progress.update(view.bars[key], completed=float(art.data or 0.0), description=art.description or key)


def _finished(run: Any, crash_grace_s: float, view: RunView, say: Callable[[str], None]) -> bool:
    """True once the run is terminal (a crash only after its grace period found no automatic retry)."""
    state = run.state.type.value if run.state else ""
    if state != "CRASHED":
        view.crashed_at = None
        return state in TERMINAL
    if view.crashed_at is None:
        view.crashed_at = time.monotonic()
        say(
            f"  {time.strftime('%H:%M:%S')}  flow run crashed: {run.state.message or ''}"
            + (f" (waiting up to {crash_grace_s:.0f} s for the automatic retry)" if crash_grace_s else "")
        )
    return time.monotonic() - view.crashed_at >= crash_grace_s


def _explain_waiting(
    client: Any, root: Any, view: RunView, after_s: float, late_after_s: float, say: Callable[[str], None]
) -> None:
    """Once the run has waited ``after_s`` in a Scheduled-type state: print why (flows/waiting.py) whenever the
    reason changes, and once it is ``late_after_s`` past its scheduled start, propose Late with that reason as
    its message (accepted only while it is still Scheduled; the local server's watcher does the same)."""
    from flows.waiting import mark_late, wait_reason

    waiting = bool(root.state and root.state.type.value == "SCHEDULED" and root.work_pool_name)
    view.waiting_since = (view.waiting_since or time.monotonic()) if waiting else None
    if not waiting or time.monotonic() - (view.waiting_since or 0.0) < after_s:
        return
    reason = wait_reason(client, root)
    if reason and reason != view.wait_reason:
        say(f"  {time.strftime('%H:%M:%S')}  flow run {root.name} waits ({root.state.name}): {reason}")
        view.wait_reason = reason
    due = root.next_scheduled_start_time
    overdue = due is not None and (datetime.now(timezone.utc) - due).total_seconds() >= late_after_s
    if reason and overdue and root.state.name == "Scheduled":
        mark_late(client, root, reason)


def follow(
    flow_run_id: UUID,
    poll_s: float = 3.0,
    timeout_s: float | None = None,
    crash_grace_s: float = 0.0,
    full_log: str | None = None,
    explain: bool = True,
    waiting_after_s: float = 10.0,
    late_after_s: float | None = None,
) -> Any:
    """Show a run's task states and progress bars until it reaches a terminal state; returns the flow run.

    A Crashed run is followed for ``crash_grace_s`` more seconds, because the crash-recovery
    automation puts it back to AwaitingRetry and a worker runs it again. A run that ends other than
    Completed is explained (``explain``): failed task, exception, last log lines and ``full_log``
    (where the complete log is). A run still not started after ``waiting_after_s`` is explained (what
    it waits for, flows/waiting.py) and, ``late_after_s`` past its schedule (default: Prefect's
    late-runs setting), marked Late with that reason.
    """
    from prefect.client.orchestration import get_client
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

    from flows.waiting import late_settings

    late_after_s = late_settings()[0] if late_after_s is None else late_after_s
    view = RunView(flow_run_id)
    deadline = time.monotonic() + timeout_s if timeout_s else None
    columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn())
    with get_client(sync_client=True) as client, Progress(*columns, transient=False) as progress:

        def say(text: str) -> None:  # whole lines (no wrapping, no rich markup): they hold paths and tracebacks
            progress.console.print(text, markup=False, highlight=False, soft_wrap=True)

        while True:
            runs = flow_run_tree(client, view)
            _print_task_changes(client, view, say)
            _update_bars(client, view, progress)
            root = next(r for r in runs if r.id == flow_run_id)
            _explain_waiting(client, root, view, waiting_after_s, late_after_s, say)
            if _finished(root, crash_grace_s, view, say):
                if explain and root.state.type.value != "COMPLETED":
                    for line in explain_run(client, root, list(view.flow_runs)).lines(full_log):
                        say(line)
                return root
            if deadline and time.monotonic() > deadline:
                raise TimeoutError(f"flow run {flow_run_id} not finished after {timeout_s:.0f} s")
            time.sleep(poll_s)


def explain_flow_run(flow_run_id: UUID, log_dir: Path) -> list[str]:
    """The failure report lines of a finished flow run and its subflows (flows/failure.py), via a new client;
    the run's whole API log is saved as ``<log_dir>/<flow run name>.log``, the report's full log."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        view = RunView(flow_run_id)
        runs = flow_run_tree(client, view)
        root = next(r for r in runs if r.id == flow_run_id)
        ids = [r.id for r in runs]
        full_log = log_dir / f"{root.name}.log"
        write_full_log(client, ids, full_log)
        return explain_run(client, root, ids).lines(str(full_log.resolve()))
