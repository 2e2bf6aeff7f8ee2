"""Child processes that live in their own process group, log to a file, and die as a group.

``SupervisedProcess`` adds restarts: it notices a dead child, appends a marker to the same log
(so one file tells the whole story), and starts it again after an exponential backoff, at most
``RestartPolicy.max_restarts`` times, then raises ``ProcessDiedError`` with the log's tail.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


def spawn_detached(
    argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> int:
    """Start ``argv`` in a new session (its own process group), stdout+stderr appended to ``log_path``."""
    return popen_detached(argv, log_path, env, cwd).pid


def popen_detached(
    argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """spawn_detached, keeping the Popen: only its holder reliably learns the exit code."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )


def read_pid_file(path: Path) -> int | None:
    """The pid recorded in ``path`` (its first word), or None when the file is missing or holds no number."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def process_cmdline(pid: int) -> list[str] | None:
    """The command line of a live process (Linux /proc), or None when it is gone or unreadable."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [arg.decode("utf-8", errors="replace") for arg in raw.split(b"\0") if arg] or None


def write_pid_file(path: Path, pid: int) -> None:
    """Record ``pid`` and this host's name in ``path`` (one line: the pid first, as read_pid_file reads it)."""
    path.write_text(f"{pid} {socket.gethostname()}\n")


def pid_file_host(path: Path) -> str | None:
    """The host that wrote the pid file (its second word), or None when missing (an older one-word file)."""
    try:
        words = path.read_text().split()
    except OSError:
        return None
    return words[1] if len(words) > 1 else None


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


def group_alive(pgid: int, reap: Callable[[int], object] | None = None) -> bool:
    """True while any process of the group exists (a dead leader's workers count: they hold ports and GPUs)."""
    (reap or _reap)(pgid)  # a zombie leader still counts as a member until it is collected
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_group(pid: int, grace_s: float = 10.0, reap: Callable[[int], object] | None = None) -> bool:
    """SIGTERM the process group led by ``pid``, then SIGKILL after ``grace_s``; True once the whole group is gone.

    ``reap`` collects the leader; a caller holding its Popen passes one that polls it, so the exit
    code is not lost to a bare waitpid.
    """
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not group_alive(pid, reap):
                return True
            time.sleep(0.05)
    return not group_alive(pid, reap)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, grandchildren, ...), whatever session or group they moved to
    (Linux /proc; empty elsewhere or when ``pid`` is gone)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        if child not in found:
            found.append(child)
            todo.extend(children.get(child, []))
    return found


def kill_tree(pid: int, grace_s: float = 5.0, reap: Callable[[int], object] | None = None) -> bool:
    """Stop the process group led by ``pid`` and every descendant with its own group (torch's launcher starts each
    rank in a session of its own, so a group kill misses them): SIGTERM to all, SIGKILL to what is left after
    ``grace_s``; True once all are gone. The caller's own group is never signalled."""
    own = os.getpgrp()
    members: set[int] = {pid}
    groups: set[int] = {pid}

    def gather() -> None:
        for member in [pid, *descendants(pid)]:
            members.add(member)
            with contextlib.suppress(ProcessLookupError):
                groups.add(os.getpgid(member))
        groups.discard(own)

    def alive() -> bool:  # zombies count as gone: a container's init may never collect re-parented ranks
        (reap or _reap)(pid)
        return any(pid_alive(m) for m in members)

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        gather()  # before signalling: a dead launcher's ranks are re-parented and no longer found below it
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, sig)
        for member in members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(member, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not alive():
                return True
            time.sleep(0.05)
    return not alive()


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def tail(path: Path, num_lines: int = 40) -> str:
    """The last lines of a log file (for error messages)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return f"(no log at {path})"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now (the kernel picks it; racy, but fine for tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """True when something accepts TCP connections on host:port.

    A connection to a free local port can land on itself: the kernel may pick that very port as the
    connection's own end (connect() prefers even ports, so a free_port() + 1 is a candidate) and TCP
    simultaneous open then connects the socket to itself. Nothing listens there, so that reads as False.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            return sock.getsockname() != sock.getpeername()
    except OSError:
        return False


def port_bindable(host: str, port: int) -> bool:
    """True when a listening server could bind host:port now (as HTTP servers do, with SO_REUSEADDR); False
    when the port is taken, OSError for other reasons (a host that is not an address of this machine).

    A port can be taken without anything listening on it: the local end of an outgoing
    connection holds a port from the same range the kernel hands out, and a server then
    fails with "Address already in use" however often it is restarted.
    """
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:  # IPv6 hosts (::1) bind an IPv6 socket
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


class ProcessDiedError(RuntimeError):
    """A supervised child died more often than its restart policy allows."""


@dataclass(frozen=True)
class RestartPolicy:
    """How often and how patiently a dead child is started again."""

    max_restarts: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0

    def delay_s(self, num_restarts_done: int) -> float:
        """Wait before the next restart: doubles each time so a crash loop does not spin."""
        return min(self.backoff_s * (2**num_restarts_done), self.max_backoff_s)


def _redact(argv: Sequence[str], secret_flags: Sequence[str]) -> list[str]:
    """argv with the value after each secret flag replaced, for logs and error messages."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg in secret_flags:
            out[i + 1] = "***"
    return out


class SupervisedProcess:
    """One child in its own process group, restarted with backoff when it dies (thread-safe)."""

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        policy: RestartPolicy = RestartPolicy(),
        grace_s: float = 10.0,
        secret_flags: Sequence[str] = (),
    ):
        self.argv, self.log_path, self.env, self.cwd = list(argv), Path(log_path), env, cwd
        self.policy, self.grace_s, self.secret_flags = policy, grace_s, tuple(secret_flags)
        self._popen: subprocess.Popen[bytes] | None = None
        self.num_restarts = 0
        self._lock = threading.RLock()

    @property
    def pid(self) -> int | None:
        """Pid of the current child (also its process group id); None before start()."""
        return self._popen.pid if self._popen is not None else None

    @property
    def last_exit_code(self) -> int | None:
        """Exit code of the current child once it ended (negative: the signal that killed it)."""
        return self._popen.returncode if self._popen is not None else None

    @property
    def printable_argv(self) -> str:
        """The command line with secrets masked."""
        return " ".join(_redact(self.argv, self.secret_flags))

    def _mark(self, text: str) -> None:
        # Markers go into the child's own log so restarts and deaths line up with its output.
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a", encoding="utf-8") as log:
            log.write(f"\n=== supervisor {time.strftime('%Y-%m-%d %H:%M:%S')}: {text}\n")

    def start(self) -> int:
        """Start the child (first time or after stop()); returns its pid."""
        with self._lock:
            self._mark(f"start: {self.printable_argv}")
            self._popen = popen_detached(self.argv, self.log_path, env=self.env, cwd=self.cwd)
            return self._popen.pid

    def alive(self) -> bool:
        """True while the child runs (polling also collects its exit code once it is gone)."""
        return self._popen is not None and self._popen.poll() is None

    def describe_death(self) -> str:
        """'pid N exited with code C' (or 'was killed by signal S') for messages."""
        code = self.last_exit_code
        if code is None:
            return f"pid {self.pid} is gone (exit code unknown)"
        if code < 0:
            return f"pid {self.pid} was killed by signal {signal.Signals(-code).name}"
        return f"pid {self.pid} exited with code {code}"

    def restart(self, should_stop: threading.Event | None = None) -> int:
        """Start the dead child again after the policy's backoff; ProcessDiedError when restarts run out."""
        with self._lock:
            death = self.describe_death()
            if self.num_restarts >= self.policy.max_restarts:
                self._mark(f"{death}; giving up after {self.num_restarts} restarts")
                raise ProcessDiedError(
                    self.failure_message(f"{death}; no restarts left ({self.policy.max_restarts} allowed)")
                )
            delay_s = self.policy.delay_s(self.num_restarts)
            self._mark(f"{death}; restart {self.num_restarts + 1}/{self.policy.max_restarts} in {delay_s:.1f} s")
            if should_stop is None:
                time.sleep(delay_s)
            elif should_stop.wait(delay_s):
                raise ProcessDiedError(self.failure_message(f"{death}; stopped while waiting to restart"))
            self.kill()  # a dead leader can leave workers behind in its group; clear them first
            self.num_restarts += 1
            return self.start()

    def kill(self) -> bool:
        """Terminate the child's whole process group; True when it is gone."""
        popen = self._popen
        if popen is None:
            return True
        return kill_group(popen.pid, grace_s=self.grace_s, reap=lambda _pid: popen.poll())

    def stop(self) -> None:
        """Kill the group for good (idempotent)."""
        with self._lock:
            if self._popen is not None:
                self._mark("stop")
                self.kill()

    def failure_message(self, what: str) -> str:
        """An error text that names the command and the log file and shows its tail."""
        return (
            f"{what}\n  command: {self.printable_argv}\n  log: {self.log_path}\n"
            f"--- last lines of {self.log_path} ---\n{tail(self.log_path)}"
        )

    def __enter__(self) -> SupervisedProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
