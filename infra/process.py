"""Child processes that live in their own process group, log to a file, and die as a group."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


def spawn_detached(argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None,
                   cwd: Path | None = None) -> int:
    """Start ``argv`` in a new session (its own process group), stdout+stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True)
    return proc.pid


def pid_alive(pid: int) -> bool:
    """True while a process with this pid exists (zombies count as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return True


def kill_group(pid: int, grace_s: float = 10.0) -> bool:
    """SIGTERM the process group led by ``pid``, then SIGKILL after ``grace_s``; True if it is gone."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            _reap(pid)
            if not pid_alive(pid):
                return True
            time.sleep(0.2)
    return not pid_alive(pid)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def tail(path: Path, num_lines: int = 40) -> str:
    """The last lines of a log file (for error messages)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return f"(no log at {path})"
