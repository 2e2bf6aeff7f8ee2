"""torchrun as data, run under supervision: own process group, full log to a file, wall-clock limit.

The trainer is launched as ``python -m torch.distributed.run ... -m eagle3.train --config <run>/config.json``.
The supervisor streams selected lines to a callback (the Prefect task logs them), keeps the whole
log in a file, kills the whole process group on timeout, and the launcher with every rank within seconds on any
exception in the caller (a cancelled flow run's SIGTERM arrives as one: infra.process.kill_tree), and
asks the kernel to SIGKILL the group leader when the supervising process dies (PR_SET_PDEATHSIG),
so a crashed orchestrator never leaves a trainer racing the next attempt. A pid file beside the
log lets the next attempt kill a leftover group from a previous host process as well.

The ranks are not in that group: torch's launcher starts each in a session of its own. They stop with
torchrun: on SIGTERM it stops its workers, and if it dies hard each rank's own PR_SET_PDEATHSIG
(eagle3/train/__main__.py) ends it.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from infra.process import group_alive, kill_group, kill_tree, pid_file_host, read_pid_file, tail, write_pid_file

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 5.0
"""When the caller stops (a cancelled flow run's SIGTERM, Ctrl-C, an error): seconds torchrun and its ranks get to
exit on SIGTERM before SIGKILL. Short on purpose: a cancel must not leave a trainer running for minutes while it
finishes its step and checkpoints (the trainer resumes from its last periodic checkpoint)."""
DEFAULT_KEEP = re.compile(r"step|loss|acc|epoch|error|warn|traceback|exception|checkpoint|resum", re.I)


class TorchrunError(RuntimeError):
    """torchrun exited non-zero or ran past its limit; the message carries the log tail."""


@dataclass(frozen=True)
class TorchrunSpec:
    """Everything that decides the torchrun command line."""

    module: str
    args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str = "eagle3"
    max_restarts: int = 0
    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)

    def argv(self) -> list[str]:
        """The command line: standalone rendezvous on one node, c10d rendezvous across nodes."""
        argv = [
            self.python,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--max-restarts={self.max_restarts}",
        ]
        if self.nnodes == 1:
            argv.append("--standalone")
        else:
            if not self.rdzv_endpoint:
                raise ValueError("multi-node torchrun needs rdzv_endpoint (host:port of the rendezvous)")
            argv += [
                f"--nnodes={self.nnodes}",
                f"--node-rank={self.node_rank}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.rdzv_endpoint}",
                f"--rdzv-id={self.rdzv_id}",
            ]
        return argv + ["-m", self.module, *self.args]


def _die_with_parent() -> None:
    """preexec_fn: new session, and SIGKILL when the parent thread that forked us exits."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def kill_leftover(pid_file: Path) -> int | None:
    """Kill the torchrun process group recorded by an earlier attempt, if it still runs; returns its pid.

    The ranks follow torchrun (module docstring), not this kill. A pid file written on another host (the run
    directory is shared; a node re-submitted after its host was lost lands elsewhere) names a process of that
    host, not of this one, so it is left alone.
    """
    pid = read_pid_file(pid_file)
    host = pid_file_host(pid_file)
    # group_alive: the leader may be gone while others of its group still run
    if pid is None or (host is not None and host != socket.gethostname()) or not group_alive(pid):
        return None
    kill_group(pid, grace_s=30.0)
    return pid


def run_torchrun(
    spec: TorchrunSpec,
    log_path: Path,
    timeout_s: float,
    on_line: Callable[[str], None] | None = None,
    keep: re.Pattern[str] = DEFAULT_KEEP,
    every_n: int = 200,
) -> None:
    """Run torchrun to completion; raise TorchrunError on failure or timeout (group killed either way)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    pid_file = log_path.with_suffix(".pid")
    kill_leftover(pid_file)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
    with open(log_path, "a", encoding="utf-8") as log:
        proc = subprocess.Popen(
            spec.argv(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        write_pid_file(pid_file, proc.pid)
        timed_out = threading.Event()

        def on_timeout() -> None:
            timed_out.set()
            kill_group(proc.pid, grace_s=30.0)

        timer = threading.Timer(timeout_s, on_timeout)
        timer.start()
        try:
            _pump(proc, log, on_line, keep, every_n)
            rc = proc.wait()
        except BaseException:  # cancelled (SIGTERM from the runner), interrupted, or the caller failed
            kill_tree(proc.pid, grace_s=STOP_GRACE_S, reap=lambda _pid: proc.poll())
            raise
        finally:
            timer.cancel()
            pid_file.unlink(missing_ok=True)
    if timed_out.is_set():
        raise TorchrunError(
            f"torchrun ran past its limit of {timeout_s:.0f} s and was killed; log {log_path}:\n{tail(log_path)}"
        )
    if rc != 0:
        raise TorchrunError(
            f"torchrun exited with {rc}; first error line: {first_error(log_path)!r}; log {log_path}:\n{tail(log_path)}"
        )


def first_error(log_path: Path) -> str:
    """The first line that looks like a rank's error (torchrun's own summary comes last and says little)."""
    pattern = re.compile(r"Traceback|Error|error:|exception", re.I)
    with open(log_path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if pattern.search(line) and "torch/distributed/elastic" not in line:
                return line.strip()[:500]
    return "(none found)"


def _pump(proc: subprocess.Popen, log, on_line, keep: re.Pattern[str], every_n: int) -> None:
    """Copy every line to the log file; pass selected ones (and every n-th) to the callback."""
    last_flush = time.monotonic()
    assert proc.stdout is not None  # (started with stdout=PIPE)
    for i, line in enumerate(proc.stdout):
        log.write(line)
        if time.monotonic() - last_flush > 1.0:
            log.flush()
            last_flush = time.monotonic()
        if on_line and (keep.search(line) or i % every_n == 0):
            on_line(line.rstrip()[:2000])
    log.flush()
