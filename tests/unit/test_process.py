"""infra.process: process groups, group kill, exit codes, supervised restarts with backoff."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from infra.process import (
    ProcessDiedError,
    RestartPolicy,
    SupervisedProcess,
    free_port,
    group_alive,
    kill_group,
    pid_alive,
    read_pid_file,
    spawn_detached,
    tail,
    write_pid_file,
)

FAST = RestartPolicy(max_restarts=2, backoff_s=0.05, max_backoff_s=0.1)


def _wait(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_spawned_child_leads_its_own_group_and_logs_to_the_file(tmp_path):
    """spawn_detached starts a new process group and appends stdout and stderr to the log."""
    log = tmp_path / "child.log"
    pid = spawn_detached(["sh", "-c", "echo out; echo err >&2; sleep 30"], log)
    try:
        assert os.getpgid(pid) == pid != os.getpgid(0)
        assert _wait(lambda: "out" in log.read_text() and "err" in log.read_text())
    finally:
        kill_group(pid, grace_s=1)


def test_kill_group_also_kills_grandchildren(tmp_path):
    """kill_group ends the leader and a grandchild it started in the same group."""
    pid_file = tmp_path / "grandchild.pid"
    pid = spawn_detached(["sh", "-c", f"sleep 30 & echo $! > {pid_file}; wait"], tmp_path / "log")
    assert _wait(lambda: pid_file.exists() and pid_file.read_text().strip() != "")
    grandchild = int(pid_file.read_text())
    assert kill_group(pid, grace_s=1)
    assert not group_alive(pid) and _wait(lambda: not pid_alive(grandchild))


def test_supervisor_reports_exit_code_and_killing_signal(tmp_path):
    """A child that exits says 'exited with code N'; one killed by a signal names the signal."""
    exited = SupervisedProcess(["sh", "-c", "exit 3"], tmp_path / "log")
    exited.start()
    assert _wait(lambda: not exited.alive())
    assert exited.last_exit_code == 3 and exited.describe_death().endswith("exited with code 3")
    with SupervisedProcess(["sleep", "30"], tmp_path / "log", grace_s=1) as killed:
        os.killpg(killed.pid, signal.SIGKILL)
        assert _wait(lambda: not killed.alive())
        assert killed.last_exit_code == -signal.SIGKILL


def test_backoff_doubles_up_to_its_cap():
    """RestartPolicy waits backoff_s * 2**n, never more than max_backoff_s."""
    policy = RestartPolicy(max_restarts=9, backoff_s=1.0, max_backoff_s=5.0)
    assert [policy.delay_s(n) for n in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_supervisor_restarts_a_killed_child_and_marks_the_log(tmp_path):
    """A SIGKILLed child is seen as dead, restarted under a new pid, and both events are in the log."""
    log = tmp_path / "sup.log"
    with SupervisedProcess(["sleep", "30"], log, policy=FAST, grace_s=1) as proc:
        first = proc.pid
        os.killpg(first, signal.SIGKILL)
        assert _wait(lambda: not proc.alive())
        assert "killed by signal SIGKILL" in proc.describe_death()
        second = proc.restart()
        assert second != first and proc.alive() and proc.num_restarts == 1
    assert not pid_alive(second)
    text = log.read_text()
    assert "restart 1/2" in text and "killed by signal SIGKILL" in text and text.rstrip().endswith("stop")


def test_supervisor_gives_up_after_max_restarts_naming_the_log(tmp_path):
    """After max_restarts deaths restart() raises ProcessDiedError with the command, log path and tail."""
    log = tmp_path / "crash.log"
    proc = SupervisedProcess([sys.executable, "-c", "print('boom: bad config'); raise SystemExit(4)"], log, policy=FAST)
    proc.start()
    for _ in range(FAST.max_restarts):
        assert _wait(lambda: not proc.alive())
        proc.restart()
    assert _wait(lambda: not proc.alive())
    with pytest.raises(ProcessDiedError) as exc:
        proc.restart()
    message = str(exc.value)
    assert "no restarts left" in message and str(log) in message and "boom: bad config" in message
    assert "exited with code 4" in message


def test_secrets_are_masked_in_the_printed_command(tmp_path):
    """The value after a secret flag never appears in the log marker or the printable argv."""
    log = tmp_path / "s.log"
    with SupervisedProcess(["sleep", "30", "--api-key", "hunter2"], log, secret_flags=("--api-key",), grace_s=1):
        pass
    assert "hunter2" not in log.read_text() and "--api-key ***" in log.read_text()


def test_free_port_can_be_bound():
    """free_port returns a loopback port that a server can bind right away."""
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_port_in_use_tells_a_listener_from_a_connection_that_landed_on_itself(monkeypatch):
    """A listening port is in use; a free one is not, even when the probe's connection lands on itself."""
    import infra.process
    from infra.process import port_in_use

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert port_in_use("127.0.0.1", server.getsockname()[1])
    port = free_port()
    assert not port_in_use("127.0.0.1", port)
    with socket.socket() as looped:  # what the kernel does when it picks `port` as the connection's own end
        looped.bind(("127.0.0.1", port))
        looped.connect(("127.0.0.1", port))  # TCP simultaneous open: connected to itself, nothing listening
        monkeypatch.setattr(infra.process.socket, "create_connection", lambda *args, **kwargs: looped)
        assert not port_in_use("127.0.0.1", port)


def test_tail_returns_the_last_lines_or_says_the_log_is_missing(tmp_path):
    """tail gives the last N lines, and a readable note when the file does not exist."""
    log = tmp_path / "t.log"
    log.write_text("\n".join(f"line {i}" for i in range(100)))
    assert tail(log, 2) == "line 98\nline 99"
    assert "no log at" in tail(Path(tmp_path / "missing.log"))


def test_pid_file_round_trip_and_bad_contents(tmp_path):
    """A written pid reads back; a missing, empty or non-numeric file reads as None (never an exception)."""
    path = tmp_path / "worker.pid"
    assert read_pid_file(path) is None
    write_pid_file(path, 4321)
    assert read_pid_file(path) == 4321
    for text in ("", "\n", "not-a-pid\n"):
        path.write_text(text)
        assert read_pid_file(path) is None


def test_port_bindable_tells_a_taken_port_from_a_free_one_on_ipv4_and_ipv6():
    """A bound (not listening) socket makes its port unbindable; ::1 is checked with an IPv6 socket; a host that
    is not this machine's raises instead of reading as taken."""
    import socket

    from infra.process import free_port, port_bindable

    port = free_port()
    assert port_bindable("127.0.0.1", port)
    if _has_ipv6_loopback():
        assert port_bindable("::1", port)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        assert not port_bindable("127.0.0.1", port)
    with pytest.raises(OSError):
        port_bindable("192.0.2.1", port)  # TEST-NET-1: never an address of this host


def _has_ipv6_loopback() -> bool:
    """Whether this host can bind ::1 at all (containers may run without IPv6)."""
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False
