"""Cancel during training (issue 39, first list, item 5): the train task run ends Cancelled, not Crashed, and
torchrun with every rank is gone within seconds, not minutes, of the cancel (real runner: `serve`, its SIGTERM
after the run turned Cancelling; the fake trainer takes 120 s to stop on SIGTERM, as a trainer finishing its step
and checkpointing does)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId
from prefect.client.schemas.objects import StateType
from prefect.settings import PREFECT_API_URL
from prefect.states import Cancelling

from infra.process import kill_group, pid_alive, read_pid_file, tail

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENT = "eagle3-test-cancel-train/cancel-probe"


def _wait(what: str, check, timeout_s: float, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def test_cancel_ends_the_train_task_cancelled_and_stops_every_rank_within_seconds(tmp_path):
    from prefect.deployments import run_deployment

    pids = tmp_path / "pids"
    log = tmp_path / "serve.log"
    env = {
        **os.environ,
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "PYTHONPATH": str(ROOT),
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
    }
    with open(log, "ab") as out:
        server = subprocess.Popen(
            [sys.executable, str(ROOT / "tests/fakes/cancel_train_flow.py")],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        with get_client(sync_client=True) as client:

            def deployed():
                try:
                    return client.read_deployment_by_name(DEPLOYMENT)
                except Exception:  # noqa: BLE001 - not registered yet
                    return None

            _wait(f"deployment (serve log: {tail(log)})", deployed, 120, poll_s=1.0)
            run = run_deployment(
                DEPLOYMENT,
                parameters={"workdir": str(tmp_path / "work"), "pid_dir": str(pids)},
                timeout=0,
                as_subflow=False,
            )
            ranks = _wait(
                "both ranks",
                lambda: (lambda p: p if len(p) == 2 else None)(
                    [int(f.read_text()) for f in sorted(pids.glob("rank*.pid"))]
                ),
                180,
            )
            launcher = read_pid_file(tmp_path / "work" / "cancel-probe" / "train" / "torchrun.pid")
            assert launcher is not None and pid_alive(launcher)
            client.set_flow_run_state(run.id, Cancelling(message="cancelled from the test"))  # the UI's Cancel
            t0 = time.monotonic()
            _wait("every rank and the launcher to die", lambda: not any(pid_alive(p) for p in [launcher, *ranks]), 90)
            stopped_after_s = time.monotonic() - t0
            final = _wait(
                "the flow run to end",
                lambda: (lambda s: s if s is not None and s.is_final() else None)(client.read_flow_run(run.id).state),
                90,
                poll_s=0.5,
            )
            assert final.type == StateType.CANCELLED, final
            time.sleep(2.0)  # task states arrive as events
            (train,) = [
                t
                for t in client.read_task_runs(
                    task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[run.id]))
                )
                if t.name.startswith("train-")
            ]
            assert train.state.type == StateType.CANCELLED, (train.state, tail(log))
            assert stopped_after_s < 20, f"ranks outlived the cancel by {stopped_after_s:.0f} s"
    finally:
        kill_group(server.pid, grace_s=10.0)
