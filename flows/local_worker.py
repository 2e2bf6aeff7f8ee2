"""A Prefect process worker for the embedded server, started in the background and reused.

The worker polls one work pool and runs each flow run of its deployments as a subprocess, as a
worker on a GPU host would; the demo and the chaos script use it so that runs go through the same
path as production (deployment -> worker -> flow process), including crash recovery.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from flows.local_server import LocalServer
from infra.process import kill_group, pid_alive, read_pid_file, spawn_detached, tail, write_pid_file


@dataclass(frozen=True)
class LocalWorker:
    """A worker of ``pool`` whose pid file and log live beside the local server's state.

    ``host`` names the worker after a host other than this machine (several "hosts" on one machine, each
    with its own ``server.home``, as the multi-host chaos run starts them)."""

    server: LocalServer
    pool: str = "gpu"
    host: str = ""

    @property
    def name(self) -> str:
        return f"eagle3-{self.host or socket.gethostname()}-{self.pool}"

    @property
    def pid_file(self) -> Path:
        return self.server.home / f"worker-{self.pool}.pid"

    @property
    def log_file(self) -> Path:
        return self.server.home / f"worker-{self.pool}.log"

    def argv(self) -> list[str]:
        """`prefect worker start` for this pool; one flow run at a time per host."""
        prefect = str(Path(sys.executable).with_name("prefect"))
        return [prefect, "worker", "start", "--pool", self.pool, "--name", self.name, "--limit", "1"]


def worker_pid(worker: LocalWorker) -> int | None:
    """The pid of this worker if it is running."""
    pid = read_pid_file(worker.pid_file)
    return pid if pid is not None and pid_alive(pid) else None


def start_worker(worker: LocalWorker, cwd: Path, wait_s: float = 60.0) -> str:
    """Start the worker unless it runs already; returns 'reused' or 'started'.

    It runs in its own session, so it outlives the command that started it (like the server), and
    a VM-loss simulation can kill it with its whole process group.
    """
    if worker_pid(worker):
        return "reused"
    env = {**os.environ, **worker.server.client_env(), "PYTHONUNBUFFERED": "1"}
    log_offset = worker.log_file.stat().st_size if worker.log_file.exists() else 0
    pid = spawn_detached(worker.argv(), worker.log_file, env=env, cwd=cwd)
    write_pid_file(worker.pid_file, pid)
    _wait_polling(worker, pid, log_offset, wait_s)
    return "started"


def _wait_polling(worker: LocalWorker, pid: int, log_offset: int, wait_s: float) -> None:
    """Wait until this start's part of the log says the worker polls its pool (or fail with the log)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            raise RuntimeError(f"prefect worker exited at start; log {worker.log_file}:\n{tail(worker.log_file)}")
        with open(worker.log_file, "rb") as fh:
            fh.seek(log_offset)
            if b"started!" in fh.read():
                return
        time.sleep(0.5)
    raise TimeoutError(f"prefect worker did not start within {wait_s:.0f} s; log {worker.log_file}")


def stop_worker(worker: LocalWorker, grace_s: float = 10.0) -> bool:
    """Stop the worker and everything in its process group. True if one was running."""
    pid = worker_pid(worker)
    worker.pid_file.unlink(missing_ok=True)
    if pid is None:
        return False
    kill_group(pid, grace_s=grace_s)
    return True
