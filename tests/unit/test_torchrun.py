"""infra.torchrun: command lines, streamed logs, failures with the log tail, timeouts that kill the group."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from infra.process import pid_alive
from infra.torchrun import TorchrunError, TorchrunSpec, kill_leftover, run_torchrun


def _spec(tmp_path, *extra: str, nproc: int = 2) -> TorchrunSpec:
    return TorchrunSpec(
        module="tests.fakes.fake_trainer",
        args=("--pid-dir", str(tmp_path / "pids"), *extra),
        nproc_per_node=nproc,
        env={"OMP_NUM_THREADS": "1"},
    )


def _rank_pids(tmp_path) -> list[int]:
    return [int(p.read_text()) for p in sorted((tmp_path / "pids").glob("rank*.pid"))]


def test_single_node_uses_standalone_rendezvous():
    """One node: --standalone; several nodes: c10d rendezvous with the endpoint, or a clear error without it."""
    assert "--standalone" in TorchrunSpec(module="m").argv()
    multi = TorchrunSpec(module="m", nnodes=2, node_rank=1, rdzv_endpoint="head:29400").argv()
    assert "--rdzv-endpoint=head:29400" in multi and "--node-rank=1" in multi and "--standalone" not in multi
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        TorchrunSpec(module="m", nnodes=2).argv()


def test_lines_stream_to_callback_and_whole_log_to_file(tmp_path):
    """Both ranks' output lands in the log; the callback gets the loss lines, not every chatter line."""
    seen: list[str] = []
    log = tmp_path / "train.log"
    run_torchrun(_spec(tmp_path), log, timeout_s=120, on_line=seen.append, every_n=10_000)
    text = log.read_text()
    assert "rank 0 step 2 loss" in text and "rank 1 step 2 loss" in text and "rank 1 chatter 2" in text
    assert sum("loss" in line for line in seen) == 6
    assert not any("chatter" in line for line in seen[1:])


def test_failure_raises_with_the_log_tail(tmp_path):
    """A non-zero exit raises TorchrunError whose message names the log and shows its last lines."""
    with pytest.raises(TorchrunError, match="(?s)exited with .*simulated failure"):
        run_torchrun(_spec(tmp_path, "--fail"), tmp_path / "train.log", timeout_s=120)


def test_timeout_kills_every_rank(tmp_path):
    """Past the wall-clock limit the whole group dies: no rank process is left."""
    t0 = time.monotonic()
    with pytest.raises(TorchrunError, match="past its limit"):
        run_torchrun(_spec(tmp_path, "--hang"), tmp_path / "train.log", timeout_s=15)
    assert time.monotonic() - t0 < 120
    pids = _rank_pids(tmp_path)
    assert len(pids) == 2 and not any(pid_alive(p) for p in pids)


def test_leftover_group_from_an_earlier_attempt_is_killed(tmp_path):
    """A pid file left by a dead supervisor points at a live group: the next attempt kills it first."""
    stale = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    pid_file = tmp_path / "train.pid"
    pid_file.write_text(f"{stale.pid}\n")
    assert kill_leftover(pid_file) == stale.pid
    stale.wait(timeout=30)
    assert not pid_alive(stale.pid)


def test_leftover_recorded_by_another_host_is_left_alone(tmp_path):
    """A pid file in the shared run directory written on another host names that host's process: not killed here;
    the same file written on this host (write_pid_file) is."""
    from infra.process import write_pid_file

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    pid_file = tmp_path / "torchrun.node1.pid"
    try:
        pid_file.write_text(f"{live.pid} another-host\n")
        assert kill_leftover(pid_file) is None and pid_alive(live.pid)
        write_pid_file(pid_file, live.pid)
        assert kill_leftover(pid_file) == live.pid
        live.wait(timeout=30)
    finally:
        live.kill()


def test_ranks_stop_when_the_supervising_process_is_sigkilled(tmp_path):
    """A SIGKILLed orchestrator takes the torchrun launcher with it, and every rank gets SIGTERM (to checkpoint)."""
    import signal

    spec = _spec(tmp_path, "--hang", "--launcher-guard")
    code = (
        "import sys; from pathlib import Path; from infra.torchrun import run_torchrun, TorchrunSpec; "
        f"run_torchrun(TorchrunSpec(module={spec.module!r}, args={spec.args!r}, nproc_per_node=2, "
        f"env={spec.env!r}), Path({str(tmp_path / 'train.log')!r}), timeout_s=300)"
    )
    supervisor = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 120
    while len(_rank_pids(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = _rank_pids(tmp_path)
    assert len(pids) == 2, "ranks did not start"
    supervisor.send_signal(signal.SIGKILL)
    supervisor.wait(timeout=30)
    deadline = time.monotonic() + 60
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in pids)
    assert sorted(p.name for p in (tmp_path / "pids").glob("*.stopped")) == ["rank0.stopped", "rank1.stopped"]


def test_an_interrupted_caller_stops_the_launcher_and_every_rank_within_seconds(tmp_path):
    """A SIGTERM (a cancelled flow run) or Ctrl-C in the supervising thread stops torchrun and both ranks in
    seconds, even though each rank takes 120 s to stop on SIGTERM (a trainer finishing its step): what is left
    after the grace is SIGKILLed, ranks in their own sessions included."""

    class Stop(BaseException):
        pass

    def interrupt(line: str) -> None:
        if len(_rank_pids(tmp_path)) == 2:
            raise Stop

    spec = _spec(tmp_path, "--hang", "--launcher-guard", "--stop-delay-s", "120")
    with pytest.raises(Stop):
        run_torchrun(spec, tmp_path / "train.log", timeout_s=300, on_line=interrupt, every_n=1)
    t0 = time.monotonic()
    pids = _rank_pids(tmp_path)
    while any(pid_alive(p) for p in pids) and time.monotonic() - t0 < 60:
        time.sleep(0.1)
    assert len(pids) == 2 and not any(pid_alive(p) for p in pids)
    assert time.monotonic() - t0 < 5  # run_torchrun returned only once they were gone
