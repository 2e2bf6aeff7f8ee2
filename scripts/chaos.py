"""VM-loss chaos run: kill the worker and the flow's processes mid-capture and mid-training, measure recovery.

    .venv/bin/python scripts/chaos.py                       # tiny target, both kills (~6-8 min on 2 cores)
    .venv/bin/python scripts/chaos.py --preset smollm2-demo --set data.sources.0.max_records=120

What it does, as a user's cluster would see it:
1. starts the embedded server (its own workdir and port), runs setup (pools, limits, the two
   automations), registers the deployments and starts a worker, then triggers `eagle3-pipeline`;
2. once some capture shards are complete, SIGKILLs the worker's and the flow's process groups
   together (a VM that vanished: nobody reports the run as crashed) and starts a new worker;
3. the heartbeat automation marks the run Crashed, the retry automation puts it back to
   AwaitingRetry, the new worker runs the same flow run again, and capture skips complete shards;
4. the same once training has written a checkpoint: training resumes from it.
It prints, per kill: seconds from the kill to Crashed, to running again and to completion, and the
work redone (shards captured again, training steps repeated); and writes them to chaos.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.config import load_config  # noqa: E402
from eagle3.features import STAGE as CAPTURE  # noqa: E402
from eagle3.train import STAGE as TRAIN  # noqa: E402
from flows import local_server  # noqa: E402
from flows.follow import deploy, trigger  # noqa: E402
from flows.local_worker import LocalWorker, start_worker, worker_pid  # noqa: E402
from infra.process import read_pid_file  # noqa: E402
from infra.storage import read_holder  # noqa: E402

TINY_OVERRIDES = ["capture.tokens_per_shard=300", "train.num_epochs=30", "train.checkpoint_every_steps=25"]
BOTH = "both"
KILL_CHOICES = (CAPTURE.name, TRAIN.name, BOTH)
"""What --kill takes: the stage whose processes are killed mid-run, or both (capture first)."""


def shard_manifests(run_dir: Path) -> dict[str, float]:
    """Complete shards (manifest written) -> manifest mtime."""
    return {p.name: p.stat().st_mtime for p in (run_dir / "features").glob("shard-*.done.json")}


def num_planned_shards(run_dir: Path) -> int | None:
    try:
        return len(json.loads((run_dir / "features" / "plan.json").read_text())["shards"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def train_progress(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "train" / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(
        int(p.name.split("-")[1])
        for p in (run_dir / "train" / "checkpoints").glob("step-*")
        if (p / "checkpoint.json").is_file()
    )


def flow_state(run_id) -> tuple[str, int]:
    """(state name, run_count) of the flow run."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
    return (run.state.name if run.state else "?"), run.run_count


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def kill_vm(worker: LocalWorker, run_dir: Path) -> list[int]:
    """SIGKILL everything a lost VM takes down: the worker's group, the flow process's group (the run lock
    names its pid) and torchrun's group (its pid file), all at once."""
    groups = set()
    pid = worker_pid(worker)
    if pid:
        groups.add(os.getpgid(pid))
    holder = read_holder(run_dir / ".lock").get("pid")
    try:
        if holder:
            groups.add(os.getpgid(holder))
    except ProcessLookupError:
        pass
    torchrun_pid = read_pid_file(run_dir / "train" / "torchrun.pid")
    if torchrun_pid is not None:  # torchrun's own group: on a lost VM it dies too, with no chance to checkpoint
        groups.add(torchrun_pid)
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    for pid in trainer_pids(run_dir):  # torchrun may start its ranks in sessions of their own
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    worker.pid_file.unlink(missing_ok=True)
    return sorted(groups)


def trainer_pids(run_dir: Path) -> list[int]:
    """Processes running `eagle3.train` on this run's config (the torchrun ranks)."""
    config, pids = str(run_dir.resolve() / "config.json"), []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"eagle3.train" in argv and config.encode() in argv:
            pids.append(int(proc.name))
    return pids


def last_logged_int(run_dir: Path, pattern: str) -> int | None:
    """The number in the last match of ``pattern`` (one group) in the trainer's log."""
    log = run_dir / "train" / "torchrun.log"
    found = re.findall(pattern, log.read_text(errors="replace")) if log.is_file() else []
    return int(found[-1]) if found else None


def logged_step(run_dir: Path) -> int | None:
    """The last optimizer step rank 0 logged ("step N/M ...")."""
    return last_logged_int(run_dir, r"\bstep (\d+)/\d+")


def state_history(run_id) -> list[tuple[str, float]]:
    """(state name, server timestamp) of every state the flow run went through."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        states = client.read_flow_run_states(run_id)
    return [(st.name, st.timestamp.timestamp()) for st in states]


def _first_after(run_id, name: str, after: float) -> float | None:
    return next((ts for n, ts in state_history(run_id) if n == name and ts > after), None)


def recover(run_id, worker: LocalWorker, wall_kill: float, timeout_s: float) -> dict:
    """Start a new worker; time Crashed and the next Running from the run's state history.

    Crashed lasts only until the retry automation fires (well under a second), so polling the
    current state could miss it; the server's state history has every transition with its time.
    """
    start_worker(worker, ROOT)
    t_crashed = wait_until(
        lambda: _first_after(run_id, "Crashed", wall_kill),
        timeout_s,
        "the heartbeat automation to mark the run Crashed",
        poll_s=2.0,
    )
    t_running = wait_until(
        lambda: _first_after(run_id, "Running", t_crashed), timeout_s, "the retried run to start again", poll_s=2.0
    )
    return {"to_crashed_s": round(t_crashed - wall_kill, 1), "to_running_again_s": round(t_running - wall_kill, 1)}


def chaos_capture(run_id, worker: LocalWorker, run_dir: Path, timeout_s: float) -> dict:
    """Kill once some (not all) shards are complete; count shards captured again afterwards."""

    def mid_capture():
        total, done = num_planned_shards(run_dir), shard_manifests(run_dir)
        return total and 2 <= len(done) < total - 1 and done

    wait_until(mid_capture, timeout_s, "capture to be part-way")
    before, wall_kill = shard_manifests(run_dir), time.time()
    groups = kill_vm(worker, run_dir)
    print(
        f"capture: SIGKILLed process groups {groups} with {len(before)}/{num_planned_shards(run_dir)} shards done",
        flush=True,
    )
    figures = recover(run_id, worker, wall_kill, timeout_s)
    wait_until(lambda: (run_dir / "features" / "capture.manifest.json").is_file(), timeout_s, "capture to finish")
    after = shard_manifests(run_dir)
    redone = [n for n in before if after.get(n, 0) > wall_kill]
    return {
        **figures,
        "to_capture_done_s": round(time.time() - wall_kill, 1),
        "shards_done_at_kill": len(before),
        "shards_total": len(after),
        "complete_shards_recaptured": len(redone),
        "shards_captured_after_kill": sum(1 for t in after.values() if t > wall_kill),
    }


def chaos_train(run_id, worker: LocalWorker, run_dir: Path, timeout_s: float) -> dict:
    """Kill after the first checkpoint; the rerun resumes from the newest checkpoint on disk."""

    def mid_train():
        prog = train_progress(run_dir)
        ckpts = checkpoint_steps(run_dir)
        return ckpts and prog.get("state") == "running" and prog.get("step", 0) > ckpts[-1] and prog

    wait_until(mid_train, timeout_s, "training to pass its first checkpoint")
    wall_kill = time.time()
    groups = kill_vm(worker, run_dir)
    time.sleep(1.0)  # let the log's last lines land
    step_at_kill, ckpt = logged_step(run_dir), checkpoint_steps(run_dir)[-1]
    print(f"train: SIGKILLed process groups {groups} at step {step_at_kill} (last checkpoint step {ckpt})", flush=True)
    figures = recover(run_id, worker, wall_kill, timeout_s)
    resumed = wait_until(lambda: _resumed_step(run_dir), timeout_s, "the trainer to resume")
    return {
        **figures,
        "step_at_kill": step_at_kill,
        "checkpoint_step": ckpt,
        "resumed_from_step": resumed,
        "steps_redone": step_at_kill - resumed,
    }


def _resumed_step(run_dir: Path) -> int | None:
    """The step the newest trainer launch resumed from, read from its log ("resuming from ... (step N, ...")."""
    return last_logged_int(run_dir, r"resuming from \S+ \(step (\d+)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--set", dest="overrides", action="append", default=None)
    parser.add_argument("--workdir", default=str(ROOT / "runs" / "chaos"))
    parser.add_argument("--port", type=int, default=4310)
    parser.add_argument("--kill", choices=KILL_CHOICES, default=BOTH)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit for each wait")
    args = parser.parse_args()
    overrides = (
        args.overrides if args.overrides is not None else (TINY_OVERRIDES if args.preset == "tiny" else [])
    ) + [f"run.workdir={args.workdir}"]
    return run_chaos(args.preset, overrides, args.workdir, args.port, args.kill, args.timeout_s)


def run_chaos(preset: str, overrides: list[str], workdir: str, port: int, kill: str, timeout_s: float) -> int:
    cfg = load_config(preset, overrides)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)  # a fresh run, so every figure is about this one
    server = local_server.for_workdir(workdir, port)
    print(f"server {local_server.start(server)}: {server.ui_url}", flush=True)
    os.environ.update(server.client_env())
    from deployments.setup import setup

    setup()
    deploy(server, ["eagle3-pipeline"], ROOT)
    worker = LocalWorker(server, "gpu")
    start_worker(worker, ROOT)
    t0 = time.monotonic()
    run_id = trigger("eagle3-pipeline/eagle3-pipeline", {"preset": preset, "overrides": overrides})
    print(f"flow run {server.ui_url}/runs/flow-run/{run_id}", flush=True)
    report: dict = {"preset": preset, "overrides": overrides, "flow_run": str(run_id)}
    if kill in (CAPTURE.name, BOTH):
        report["capture_kill"] = chaos_capture(run_id, worker, cfg.run_dir, timeout_s)
    if kill in (TRAIN.name, BOTH):
        report["train_kill"] = chaos_train(run_id, worker, cfg.run_dir, timeout_s)
    state = wait_until(
        lambda: (s := flow_state(run_id))[0] in ("Completed", "Failed", "Crashed", "Cancelled") and s,
        timeout_s,
        "the run to finish",
    )
    report.update(final_state=state[0], run_count=state[1], total_s=round(time.monotonic() - t0, 1))
    (Path(workdir) / "chaos.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if state[0] == "Completed" else 1


if __name__ == "__main__":
    sys.exit(main())
