"""VM loss survived by another host: SIGKILL one "host" mid-capture and another mid-training, measure recovery.

    PYTHONPATH=. .venv/bin/python scripts/chaos_hosts.py                  # 4 hosts, both kills (~15 min on 2 cores)
    PYTHONPATH=. .venv/bin/python scripts/chaos_hosts.py --hosts 2 --kill capture

Each host is a gpu-pool worker with a name and a PREFECT_HOME of its own (`<workdir>/hosts/<name>`); every
process it starts (slice and node flow runs, the in-process target, torchrun and its ranks) inherits that
PREFECT_HOME, which is how this script finds "every process of the host" to SIGKILL at once. All hosts share
the run directory, as hosts share NFS. A separate worker, `head`, runs the parent `eagle3-pipeline` flow run
(the parent's own loss is what scripts/chaos.py covers).

1. The run captures with capture.num_slices = hosts; once host-b's slice has complete shards and at least two
   to go, every process of host-b is SIGKILLed. The heartbeat automation marks its slice run Crashed, the
   parent submits the slice again and a surviving host captures what was left (complete shards are skipped).
2. Training runs with train.nnodes = 2; once it has a checkpoint, every process of the host whose node runs
   global rank 0 is SIGKILLed. The other node's torchrun fails, the killed node's run is marked Crashed, the
   parent submits both nodes again and they land on the two hosts still alive (so a run with both kills needs
   4 hosts: 2 left after two losses), resuming from the newest checkpoint.
No worker is ever started again on a dead host. The figures go to `<workdir>/chaos_hosts.json`; the final
shards are checked (sha256 as in the done files, sample ids the plan's, each once). The server keeps running, so
the runs can be looked at in its UI: `eagle3 server stop --workdir <workdir> --port 4320` ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from chaos import (  # noqa: E402
    BOTH,
    KILL_CHOICES,
    TINY_OVERRIDES,
    checkpoint_steps,
    flow_state,
    shard_manifests,
    state_history,
    train_progress,
    wait_until,
)
from kill_checks import check_shards  # noqa: E402

from eagle3.config import load_config  # noqa: E402
from eagle3.features import STAGE as CAPTURE  # noqa: E402
from eagle3.run.registry import UNTIL_CHOICES  # noqa: E402
from eagle3.train import STAGE as TRAIN  # noqa: E402
from flows import local_server  # noqa: E402
from flows.follow import deploy, trigger  # noqa: E402
from flows.local_server import LocalServer  # noqa: E402
from flows.local_worker import LocalWorker, start_worker, stop_worker  # noqa: E402

SLICE, NODE = "eagle3-capture-slice", "eagle3-train-node"
EXTRA = ["evaluate.num_prompts=1", "evaluate.max_new_tokens=8"]
"""Keeps the evaluation after training short: the figures here are about recovery."""


def host_pids(worker: LocalWorker) -> list[int]:
    """Every process of this host: those whose environment names its PREFECT_HOME (inherited by all it starts)."""
    entry, pids = b"PREFECT_HOME=" + str(worker.server.home.resolve()).encode(), []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if entry in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def kill_host(worker: LocalWorker) -> list[int]:
    """SIGKILL every process of the host, again until none is left (one may have forked meanwhile)."""
    killed: set[int] = set()
    for _ in range(20):
        pids = [p for p in host_pids(worker) if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    worker.pid_file.unlink(missing_ok=True)
    return sorted(killed)


def fanout_runs(deployment: str) -> list:
    """Flow runs of the deployment named ``deployment`` (slice or node runs), oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    with get_client(sync_client=True) as client:
        deps = client.read_deployments(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment])))
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id={"any_": [d.id for d in deps]}))
    return sorted(runs, key=lambda r: r.created)


def picked_by(hosts: dict[str, LocalWorker]) -> dict[str, str]:
    """Flow run id -> host whose worker ran it, from each worker's log (two workers may both try to submit a run;
    the server aborts all but one, and the others log that)."""
    found = {}
    for host, worker in hosts.items():
        text = worker.log_file.read_text(errors="replace") if worker.log_file.is_file() else ""
        aborted = set(re.findall(r"Aborted submission of flow run '([0-9a-f-]+)'", text))
        found.update(
            {
                run_id: host
                for run_id in re.findall(r"submitting flow run '([0-9a-f-]+)'", text)
                if run_id not in aborted
            }
        )
    return found


def first_state(run_id, name: str, after: float) -> float | None:
    """Server time of the run's first state ``name`` after ``after``."""
    return next((ts for n, ts in state_history(run_id) if n == name and ts > after), None)


def first_final(run_id, after: float) -> tuple[str, float] | None:
    return next(
        (
            (n, ts)
            for n, ts in state_history(run_id)
            if ts > after and n in ("Completed", "Failed", "Crashed", "Cancelled")
        ),
        None,
    )


def done_shards(run_dir: Path) -> dict[int, float]:
    """Complete shard index -> its done file's mtime."""
    return {int(name[6:11]): t for name, t in shard_manifests(run_dir).items()}


def in_flight(run_id) -> list[int]:
    """Shards whose task run in flow run ``run_id`` is Running (after a kill: those the dead host was capturing)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    return sorted(
        int(m.group(1)) for t in tasks if t.state and t.state.is_running() and (m := re.search(r"shard-(\d+)$", t.name))
    )


def start_hosts(names: list[str], workdir: Path, port: int) -> dict[str, LocalWorker]:
    """One gpu-pool worker per host name, each with its own home, started together (it polls every 2 s)."""
    hosts = {}
    for name in names:
        home = workdir / "hosts" / name
        home.mkdir(parents=True, exist_ok=True)
        hosts[name] = LocalWorker(LocalServer(home, port), "gpu", host=name)
    with ThreadPoolExecutor(len(hosts)) as pool:
        list(pool.map(lambda w: start_worker(w, ROOT, wait_s=180.0), hosts.values()))
    return hosts


def chaos_capture(hosts: dict[str, LocalWorker], run_dir: Path, victim: str, t0: float, timeout_s: float) -> dict:
    """Kill ``victim`` while its slice is part-way; time the slice's Crashed, re-submission and restart."""

    def victim_slice():
        picks = picked_by(hosts)
        run = next((r for r in fanout_runs(SLICE) if picks.get(str(r.id)) == victim), None)
        if run is None:
            return None
        done = done_shards(run_dir)
        mine = run.parameters["shards"]
        return sum(s in done for s in mine) >= 1 and sum(s not in done for s in mine) >= 2 and run

    run = wait_until(victim_slice, timeout_s, f"{victim}'s capture slice to be part-way")
    shards, wall_kill, before = run.parameters["shards"], time.time(), done_shards(run_dir)
    killed = kill_host(hosts[victim])
    flying = in_flight(run.id)  # its task runs stay Running: nobody is left to report their end
    print(
        f"capture: killed {victim} ({len(killed)} processes) with {len(before)} shards complete, its slice "
        f"{run.name} at {sum(s in before for s in shards)}/{len(shards)}",
        flush=True,
    )
    t_crashed = wait_until(lambda: first_state(run.id, "Crashed", wall_kill), timeout_s, "the slice run Crashed", 2.0)
    again = wait_until(
        lambda: next(
            (
                r
                for r in fanout_runs(SLICE)
                if r.parameters["shards"] == shards and r.id != run.id and picked_by(hosts).get(str(r.id))
            ),
            None,
        ),
        timeout_s,
        "the slice to be submitted again and picked up",
        2.0,
    )
    t_running = wait_until(lambda: first_state(again.id, "Running", wall_kill), timeout_s, "the new slice run", 2.0)
    wait_until(lambda: (run_dir / "features" / "capture.manifest.json").is_file(), timeout_s, "capture to finish")
    after = done_shards(run_dir)
    return {
        "victim": victim,
        "killed_processes": len(killed),
        "kill_at_s": round(wall_kill - t0, 1),
        "slice": run.name,
        "slice_shards": len(shards),
        "slice_shards_done_at_kill": sum(s in before for s in shards),
        "shards_in_flight_at_kill": flying,
        "shards_done_at_kill": len(before),
        "shards_total": len(after),
        "to_crashed_s": round(t_crashed - wall_kill, 1),
        "resubmitted_as": again.name,
        "resubmitted_to_host": picked_by(hosts)[str(again.id)],
        "to_running_again_s": round(t_running - wall_kill, 1),
        "to_capture_done_s": round(time.time() - wall_kill, 1),
        "complete_shards_recaptured": sum(1 for s, t in before.items() if after.get(s, 0) > t),
        "shards_captured_after_kill": sum(1 for t in after.values() if t > wall_kill),
    }


def logs_text(run_dir: Path, offsets: dict[Path, int] | None = None) -> dict[Path, str]:
    """Each node's torchrun log (from ``offsets`` when given)."""
    out = {}
    for log in sorted((run_dir / "train").glob("torchrun*.log")):
        with open(log, "rb") as fh:
            fh.seek((offsets or {}).get(log, 0))
            out[log] = fh.read().decode(errors="replace")
    return out


def last_int(texts: dict[Path, str], pattern: str) -> int | None:
    found = [int(m) for text in texts.values() for m in re.findall(pattern, text)[-1:]]
    return max(found) if found else None


def chaos_train(hosts: dict[str, LocalWorker], dead: set[str], run_dir: Path, t0: float, timeout_s: float) -> dict:
    """Kill the host of global rank 0 after the first checkpoint; time both nodes' re-submission on live hosts."""

    def mid_train():
        ckpts, prog = checkpoint_steps(run_dir), train_progress(run_dir)
        runs = [r for r in fanout_runs(NODE) if r.name.endswith("-try1")]
        picks = picked_by(hosts)
        return (
            ckpts
            and prog.get("state") == "running"
            and prog.get("step", 0) > ckpts[-1]
            and len(runs) == 2
            and all(str(r.id) in picks for r in runs)
            and runs
        )

    runs = wait_until(mid_train, timeout_s, "multi-node training to pass its first checkpoint")
    rank0_log = next(log for log, text in logs_text(run_dir).items() if "[rank 0] step" in text)
    node = int(re.search(r"node(\d+)", rank0_log.name).group(1))
    run = next(r for r in runs if r.parameters["node_rank"] == node)
    victim = picked_by(hosts)[str(run.id)]
    offsets = {log: log.stat().st_size for log in logs_text(run_dir)}
    wall_kill = time.time()
    killed = kill_host(hosts[victim])
    time.sleep(1.0)  # let the survivors' last lines land
    step, ckpt = last_int(logs_text(run_dir), r"\bstep (\d+)/\d+"), checkpoint_steps(run_dir)[-1]
    dead.add(victim)
    print(
        f"train: killed {victim} ({len(killed)} processes, node {node}, global rank 0) at step {step} "
        f"(newest checkpoint step {ckpt})",
        flush=True,
    )
    other = next(r for r in runs if r.id != run.id)
    t_crashed = wait_until(lambda: first_state(run.id, "Crashed", wall_kill), timeout_s, "the node run Crashed", 2.0)
    other_end = wait_until(lambda: first_final(other.id, wall_kill), timeout_s, "the surviving node run to end", 2.0)
    retry = wait_until(
        lambda: (
            (new := [r for r in fanout_runs(NODE) if r.name.endswith("-try2")])
            and len(new) == 2
            and all(first_state(r.id, "Running", wall_kill) for r in new)
            and new
        ),
        timeout_s,
        "both nodes to run again",
        2.0,
    )
    resumed = wait_until(
        lambda: last_int(logs_text(run_dir, offsets), r"resuming from \S+ \(step (\d+)"),
        timeout_s,
        "the trainer to resume",
    )
    landed = sorted(picked_by(hosts)[str(r.id)] for r in retry)
    return {
        "victim": victim,
        "victim_node_rank": node,
        "killed_processes": len(killed),
        "kill_at_s": round(wall_kill - t0, 1),
        "step_at_kill": step,
        "checkpoint_step": ckpt,
        "to_crashed_s": round(t_crashed - wall_kill, 1),
        "surviving_node_ended": other_end[0],
        "surviving_node_ended_after_s": round(other_end[1] - wall_kill, 1),
        "nodes_rerun_on_hosts": landed,
        "nodes_on_dead_hosts": sorted(set(landed) & dead),
        "to_running_again_s": round(max(first_state(r.id, "Running", wall_kill) for r in retry) - wall_kill, 1),
        "resumed_from_step": resumed,
        "steps_redone": step - resumed if step is not None else None,
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_chaos_hosts(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir).resolve()
    names = [f"host-{chr(ord('a') + i)}" for i in range(args.hosts)]
    overrides = [
        *(args.overrides if args.overrides is not None else TINY_OVERRIDES),
        *EXTRA,
        f"run.workdir={workdir}",
        f"capture.num_slices={args.hosts}",
    ]
    if args.kill != CAPTURE.name:
        overrides += ["train.nnodes=2", f"train.rdzv_endpoint=127.0.0.1:{free_port()}"]
    until = CAPTURE.name if args.kill == CAPTURE.name else UNTIL_CHOICES[-1]  # capture alone: stop after it
    cfg = load_config(args.preset, overrides)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)  # a fresh run, so every figure is about this one
    shutil.rmtree(workdir / "hosts", ignore_errors=True)
    server = local_server.for_workdir(workdir, args.port)
    print(f"server {local_server.start(server)}: {server.ui_url}", flush=True)
    os.environ.update({**server.client_env(), "PREFECT_WORKER_QUERY_SECONDS": "2"})
    from deployments.setup import setup

    setup(inference_slots=args.hosts * cfg.capture.max_concurrent_shards)
    deploy(server, ["eagle3-pipeline", SLICE, NODE], ROOT)
    head = LocalWorker(server, "gpu", host="head")
    start_worker(head, ROOT)
    t0 = time.time()
    run_id = trigger("eagle3-pipeline/eagle3-pipeline", {"preset": args.preset, "overrides": overrides, "until": until})
    wait_until(lambda: flow_state(run_id)[0] == "Running", args.timeout_s, "the head worker to start the run")
    hosts = start_hosts(names, workdir, server.port)  # after the parent runs on head, so no host takes it
    print(f"flow run {server.ui_url}/runs/flow-run/{run_id}; hosts {names}", flush=True)
    report: dict = {"preset": args.preset, "overrides": overrides, "flow_run": str(run_id), "hosts": names}
    dead: set[str] = set()
    if args.kill in (CAPTURE.name, BOTH):
        report["capture_kill"] = chaos_capture(hosts, cfg.run_dir, "host-b", t0, args.timeout_s)
        dead.add("host-b")
    if args.kill in (TRAIN.name, BOTH):
        report["train_kill"] = chaos_train(hosts, dead, cfg.run_dir, t0, args.timeout_s)
    state = wait_until(
        lambda: (s := flow_state(run_id))[0] in ("Completed", "Failed", "Crashed", "Cancelled") and s,
        args.timeout_s,
        "the run to finish",
        2.0,
    )
    picks = picked_by(hosts)
    report["runs_per_host"] = {
        h: sorted(r.name for r in fanout_runs(SLICE) + fanout_runs(NODE) if picks.get(str(r.id)) == h) for h in names
    }
    shards = check_shards(cfg.run_dir)
    report.update(
        final_state=state[0],
        parent_run_count=state[1],
        total_s=round(time.time() - t0, 1),
        dead_hosts=sorted(dead),
        shard_check=shards.to_json(),
    )
    stop_worker(head)  # not kill_host: the server shares head's PREFECT_HOME and stays up for its UI
    for worker in hosts.values():
        kill_host(worker)
    (workdir / "chaos_hosts.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if state[0] == "Completed" and shards.passed else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=None,
        help="dotted overrides instead of the tiny defaults (30 shards, 30 epochs, checkpoint every 25)",
    )
    parser.add_argument("--workdir", default=str(ROOT / "runs" / "chaos-hosts"))
    parser.add_argument("--port", type=int, default=4320)
    parser.add_argument("--hosts", type=int, default=4, help="gpu-pool workers besides the head (capture slices)")
    parser.add_argument("--kill", choices=KILL_CHOICES, default=BOTH)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit for each wait")
    args = parser.parse_args()
    lost = 2 if args.kill == BOTH else 1
    if args.kill != CAPTURE.name and args.hosts - lost < 2:
        parser.error(f"--kill {args.kill} with train.nnodes=2 needs {lost + 2} hosts (2 alive after {lost} lost)")
    if args.hosts < 2:
        parser.error("--hosts must be at least 2 (one to lose, one to survive)")
    return run_chaos_hosts(args)


if __name__ == "__main__":
    sys.exit(main())
