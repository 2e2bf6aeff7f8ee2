"""`eagle3`: the console script (the top of the house).

    eagle3 demo                      server + setup + deployment + worker; trigger the demo run and follow it
    eagle3 run --preset tiny --set data.val_fraction=0.2   the flow in this process, with progress bars
    eagle3 worker start --pool gpu   a background worker of a work pool
    eagle3 server start|stop|status  the embedded Prefect server (SQLite under <workdir>/.prefect, or --database URL)
    eagle3 setup                     work pools, limits, automations, every deployment, a worker per pool
    eagle3 target --preset smollm2-demo   tokenizer sanity report
    eagle3 stage tokenize --preset tiny   one stage without Prefect (any stage of eagle3.run.registry, or all)
    eagle3 doctor --preset tiny      can this machine run the preset? versions, optional pieces, fixes
    eagle3 presets

Prefect is imported only after PREFECT_API_URL points at the local server, because Prefect
reads its settings once at import.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

from eagle3.config import RunConfig, list_presets
from eagle3.run import registry
from eagle3.run.cli_args import add_config_args, config_from_args, exit_on_user_error
from eagle3.run.layout import run_layout
from eagle3.run.registry import DATA_BLOCK, DATA_STAGES, UNTIL_CHOICES, data_block_main, get_stage
from flows import local_server
from flows.follow import deployment_pools, follow, trigger
from flows.local_worker import LocalWorker, start_worker, stop_worker, worker_pid
from flows.report import print_stage_seconds, print_summary, results_from_disk

ROOT = Path(__file__).resolve().parents[1]
WORK_POOLS = ("cpu", "gpu")
PIPELINE_DEPLOYMENT = "eagle3-pipeline"


def _server_for(args: argparse.Namespace) -> local_server.LocalServer:
    workdir = getattr(args, "workdir", None) or os.environ.get("EAGLE3_WORKDIR", "runs")
    return local_server.for_workdir(workdir, getattr(args, "port", None), getattr(args, "database", None))


def _use_server(server: local_server.LocalServer) -> None:
    state = local_server.start(server)
    os.environ.update(server.client_env())
    print(f"prefect server {state}: UI {server.ui_url}", flush=True)


def cmd_server(args: argparse.Namespace) -> int:
    """eagle3 server start|stop|status (stop also stops this workdir's workers)."""
    server = _server_for(args)
    if args.action == "start":
        t0 = time.monotonic()
        state = local_server.start(server)
        print(
            f"prefect server {state} in {time.monotonic() - t0:.1f} s on {local_server.running_database(server)}: "
            f"UI {server.ui_url}  API {server.api_url}"
        )
    elif args.action == "stop":
        for pool in WORK_POOLS:
            if stop_worker(LocalWorker(server, pool)):
                print(f"worker for pool {pool} stopped")
        print("stopped" if local_server.stop(server) else "no server of this workdir was running")
    else:
        workers = {pool: worker_pid(LocalWorker(server, pool)) for pool in WORK_POOLS}
        print(json.dumps({**local_server.status(server), "worker_pids": workers}, indent=2))
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """eagle3 worker start|stop|status: a background process worker of one pool on the local server."""
    server = _server_for(args)
    worker = LocalWorker(server, args.pool)
    if args.action == "start":
        _use_server(server)
        print(f"worker {worker.name} {start_worker(worker, ROOT)}; log {worker.log_file}")
    elif args.action == "stop":
        print("stopped" if stop_worker(worker) else f"no worker for pool {args.pool} was running")
    else:
        print(json.dumps({"pool": args.pool, "pid": worker_pid(worker), "log": str(worker.log_file)}, indent=2))
    return 0


def _follow_in_thread(t0: float) -> threading.Thread:
    """Draw the progress bars of the newest pipeline run that started after ``t0`` (the one this process runs).

    A failure is explained by run_here, which has the final state, not by this view."""

    def loop() -> None:
        run_id = _wait_for_own_run(t0)
        if run_id is not None:
            follow(run_id, poll_s=2.0, explain=False)

    thread = threading.Thread(target=loop, daemon=True, name="eagle3-progress")
    thread.start()
    return thread


def _wait_for_own_run(t0: float, wait_s: float = 120.0):
    from datetime import datetime, timezone

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterStartTime

    after = datetime.fromtimestamp(t0, timezone.utc)
    deadline = time.monotonic() + wait_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=after)))
            roots = [r for r in runs if r.parent_task_run_id is None]
            if roots:
                return roots[0].id
            time.sleep(1.0)
    return None


def cmd_run(args: argparse.Namespace) -> int:
    """Run the pipeline flow in this process against the local server, with live progress bars."""
    cfg = config_from_args(args)
    args.workdir = cfg.run.workdir
    server = _server_for(args)
    _use_server(server)
    code = run_here(cfg, args.force, args.until, progress=not args.no_progress)
    print(f"\nPrefect UI: {server.ui_url}   run directory: {cfg.run_dir.resolve()}")
    return code


def run_here(cfg: RunConfig, force: bool, until: str, progress: bool = True) -> int:
    """Run the pipeline flow in this process and print its summary; a failed run is explained
    (failed task, exception, last log lines, full log saved under <run>/logs/). Returns the exit code."""
    from prefect.logging.handlers import APILogHandler

    from flows.follow import explain_flow_run
    from flows.pipeline import eagle3_pipeline

    t0 = time.time()
    follower = _follow_in_thread(t0) if progress else None
    state = eagle3_pipeline(config=cfg, force=force, until=until, return_state=True)
    if follower:
        follower.join(timeout=15)
    if not state.is_completed():
        print_summary(results_from_disk(cfg), time.time() - t0, outcome=f"did not complete ({state.name})")
        APILogHandler().flush()  # the last log lines, the traceback among them, are still in this process's queue
        flow_run_id = state.state_details.flow_run_id
        assert flow_run_id is not None  # (the state of a flow run names it)
        print("\n" + "\n".join(explain_flow_run(flow_run_id, run_layout(cfg).logs)), flush=True)
        return 1
    result = state.result()
    print_summary(results_from_disk(cfg) | {k: v for k, v in result.items() if k in DATA_STAGES}, time.time() - t0)
    print_stage_seconds(cfg, str(state.state_details.flow_run_id))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job as a user runs it: server, setup, deployment, worker; trigger the run and follow it."""
    cfg = config_from_args(args)
    args.workdir = cfg.run.workdir
    server = _server_for(args)
    _use_server(server)
    setup_local(server, start_workers=True)
    worker = LocalWorker(server, deployment_pools(ROOT)[PIPELINE_DEPLOYMENT])
    params = (
        {"config": json.loads(cfg.model_dump_json())}
        if args.config
        else {"preset": args.preset, "overrides": list(args.overrides)}
    )
    t0 = time.monotonic()
    run_id = trigger(f"eagle3-pipeline/{PIPELINE_DEPLOYMENT}", {**params, "force": args.force, "until": args.until})
    print(f"flow run {server.ui_url}/runs/flow-run/{run_id}", flush=True)
    final = follow(run_id, crash_grace_s=240.0, full_log=str(worker.log_file))
    completed = final.state.type.value == "COMPLETED"
    print_summary(
        results_from_disk(cfg),
        time.monotonic() - t0,
        outcome="finished" if completed else f"did not complete ({final.state.name}; why: above)",
    )
    print_stage_seconds(cfg, str(run_id))
    print(
        f"\nflow run {final.name}: {final.state.name}\nPrefect UI: {server.ui_url}/runs/flow-run/{run_id}"
        f"\nrun directory: {cfg.run_dir.resolve()}\nworker log: {worker.log_file}"
        "\n(the server and the workers keep running; `eagle3 server stop` stops them all)"
    )
    return 0 if completed else 1


def cmd_setup(args: argparse.Namespace) -> int:
    """Work pools, concurrency limits, crash-recovery automations, every deployment of prefect.yaml and a
    worker for each pool they use, on the local server (idempotent)."""
    server = _server_for(args)
    _use_server(server)
    setup_local(server, not args.no_workers, args.gpu_slots, args.inference_slots)
    return 0


def setup_local(
    server: local_server.LocalServer, start_workers: bool, gpu_slots: int = 1, inference_slots: int = 4
) -> dict[str, list[str]]:
    """deployments.setup, then every deployment in prefect.yaml (created, or kept with its schedules and upcoming
    runs as they are: deployments.setup.apply_deployments), then a local worker per work pool they use (started,
    or the command that starts it printed). Returns {pool: deployment names}."""
    from deployments.setup import apply_deployments, setup

    print(json.dumps(setup(gpu_slots, inference_slots), indent=2), flush=True)
    pools: dict[str, list[str]] = {}
    for name, pool in deployment_pools(ROOT).items():
        pools.setdefault(pool, []).append(name)
    for line in apply_deployments(
        [n for names in pools.values() for n in names], ROOT, {**os.environ, **server.client_env()}
    ):
        print(line, flush=True)
    for pool, names in pools.items():
        worker = LocalWorker(server, pool)
        if start_workers:
            print(
                f"worker {worker.name} {start_worker(worker, ROOT)} for {', '.join(names)} (log {worker.log_file})",
                flush=True,
            )
        else:
            print(
                f"registered {', '.join(names)} on pool {pool}; their runs wait until a worker runs: "
                f"`eagle3 worker start --pool {pool}` (this host) or `prefect worker start --pool {pool}`",
                flush=True,
            )
    return pools


def cmd_doctor(args: argparse.Namespace) -> int:
    """Can this machine run the preset? (flows/doctor.py)"""
    from flows.doctor import run_doctor

    return run_doctor(args.preset)


def cmd_target(args: argparse.Namespace) -> int:
    """Prepare the target and print its tokenizer report."""
    argv = ["--config", str(args.config)] if args.config else ["--preset", args.preset]
    entry_point(args.entry)(argv + [f"--set={o}" for o in args.overrides])
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    """Promote the run's export, roll back, or show the current drafter (eagle3.refresh.promote)."""
    flags = ["--rollback"] * args.rollback + ["--status"] * args.status
    entry_point("eagle3.refresh.promote")(_config_argv(args) + flags)
    return 0


def cmd_refresh(args: argparse.Namespace) -> int:
    """One refresh of the run without Prefect (python -m eagle3.refresh)."""
    entry_point("eagle3.refresh")(_config_argv(args))
    return 0


def _config_argv(args: argparse.Namespace) -> list[str]:
    return (["--config", str(args.config)] if args.config else ["--preset", args.preset]) + [
        f"--set={o}" for o in args.overrides
    ]


def cmd_stage(args: argparse.Namespace) -> int:
    """One stage of the registry without Prefect (its module's ``main``), or every data stage (``all``)."""
    argv = ["--config", str(args.config)] if args.config else ["--preset", args.preset]
    argv += [f"--set={o}" for o in args.overrides] + (["--force"] if args.force else [])
    stage_entry(args.stage)(argv)
    return 0


def stage_entry(name: str):
    """The ``main(argv)`` of ``eagle3 stage NAME``: the stage module's own (eagle3.run.registry), or the data
    block's for ``all``."""
    return data_block_main if name == DATA_BLOCK else get_stage(name).main


EXAMPLES = """\
examples:
  eagle3 demo                                  the demo: local server, worker, deployment run, followed live
  eagle3 demo --set data.sources.0.max_records=1000
  eagle3 run --preset tiny --set data.val_fraction=0.2      run the flow in this process with progress bars
  eagle3 run --preset smollm2-demo --until vocab            stop after the data stages
  eagle3 server start | stop | status          the embedded Prefect server (SQLite under runs/.prefect)
  eagle3 server start --database postgresql+asyncpg://prefect@127.0.0.1:55432/prefect   on PostgreSQL
  eagle3 worker start --pool gpu               a background process worker for a work pool
  eagle3 setup                                 pools, limits, automations, all deployments, a worker per pool
  eagle3 target --preset smollm2-demo          tokenizer sanity report for the target
  eagle3 stage tokenize --preset tiny          one stage without Prefect (every stage; `all`: the data stages)
  eagle3 export --config runs/smollm2-demo/config.json      SGLang + speculators export of a trained run
  eagle3 eval --config runs/smollm2-demo/config.json        measured acceptance length (speculative decoding)
  eagle3 refresh --preset tiny --set refresh.prompts=new/   one refresh: new prompts, candidate, gate, promotion
  eagle3 promote --preset tiny --rollback      point the run's `current` drafter back at the one it replaced
  eagle3 doctor                                what the demo preset needs and is missing, with the fixes
  eagle3 presets                               list the presets in configs/
"""


def _add_pipeline_args(p: argparse.ArgumentParser, func) -> None:
    p.add_argument(
        "--until",
        choices=UNTIL_CHOICES,
        default=UNTIL_CHOICES[-1],
        help=f"last stage to run (default: {UNTIL_CHOICES[-1]})",
    )
    p.add_argument("--force", action="store_true", help="recompute every stage")
    p.add_argument("--port", type=int, help="local Prefect server port (default 4200)")
    p.set_defaults(func=func)


def _add_local_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default=None, help="workdir whose .prefect/ holds the server (default runs)")
    p.add_argument("--port", type=int, help="local Prefect server port (default 4200)")


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of the console script."""
    parser = argparse.ArgumentParser(
        prog="eagle3",
        description="EAGLE-3 drafter pipeline",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = add_config_args(sub.add_parser("demo", help="the demo: server + worker + deployment run, followed live"))
    demo.set_defaults(preset="smollm2-demo")
    _add_pipeline_args(demo, cmd_demo)
    run = add_config_args(sub.add_parser("run", help="run the pipeline flow in this process, with progress bars"))
    _add_pipeline_args(run, cmd_run)
    run.add_argument("--no-progress", action="store_true", help="no progress bars (logs only)")
    server = sub.add_parser("server", help="the embedded Prefect server (start|stop|status)")
    server.add_argument("action", choices=("start", "stop", "status"))
    _add_local_server_args(server)
    server.add_argument(
        "--database",
        metavar="URL",
        help="start: run on this database, e.g. postgresql+asyncpg://"
        "user:pass@host:5432/db (default SQLite; also PREFECT_SERVER_DATABASE_CONNECTION_URL)",
    )
    server.set_defaults(func=cmd_server)
    worker = sub.add_parser("worker", help="a background Prefect worker for a work pool (start|stop|status)")
    worker.add_argument("action", choices=("start", "stop", "status"))
    worker.add_argument("--pool", choices=WORK_POOLS, default="gpu")
    _add_local_server_args(worker)
    worker.set_defaults(func=cmd_worker)
    setup = sub.add_parser("setup", help="pools, limits, automations, every deployment, a worker per pool (idempotent)")
    _add_local_server_args(setup)
    setup.add_argument("--gpu-slots", type=int, default=1)
    setup.add_argument("--inference-slots", type=int, default=4)
    setup.add_argument(
        "--no-workers",
        action="store_true",
        help="register the deployments but start no local worker (print how to start one)",
    )
    setup.set_defaults(func=cmd_setup)
    target = add_config_args(sub.add_parser("target", help="tokenizer sanity report for the target"))
    target.set_defaults(func=cmd_target, entry="eagle3.target.load")
    stage = add_config_args(sub.add_parser("stage", help="run one stage without Prefect (all: the data stages)"))
    stage.add_argument("stage", choices=(*(s.name for s in registry.STAGES), DATA_BLOCK))
    stage.add_argument("--force", action="store_true", help="recompute even if the manifest matches")
    stage.set_defaults(func=cmd_stage)
    _add_core_commands(sub)
    _add_refresh_commands(sub)
    doctor = sub.add_parser(
        "doctor",
        help="versions, optional pieces, Prefect API, disk, presets; exit 1 if the chosen preset lacks something",
    )
    doctor.add_argument("--preset", default="smollm2-demo", help="preset to check for (default smollm2-demo)")
    doctor.set_defaults(func=cmd_doctor)
    sub.add_parser("presets", help="list presets").set_defaults(func=lambda a: print("\n".join(list_presets())) or 0)
    return parser


def _add_refresh_commands(sub) -> None:
    """refresh (one round without Prefect) and promote (which drafter of the run is current: docs/refresh.md)."""
    refresh = add_config_args(sub.add_parser("refresh", help="new prompts, warm-started candidate, gate, promotion"))
    refresh.set_defaults(func=cmd_refresh)
    promote = add_config_args(sub.add_parser("promote", help="promote the run's export; --rollback; --status"))
    action = promote.add_mutually_exclusive_group()
    action.add_argument("--rollback", action="store_true", help="return to the drafter the current one replaced")
    action.add_argument("--status", action="store_true", help="show the current drafter and the events only")
    promote.set_defaults(func=cmd_promote)


def _add_core_commands(sub) -> None:
    """export / eval (the registry's stages with a command): core stages without Prefect, forwarded to their
    `python -m` entry points."""
    for stage in (s for s in registry.STAGES if s.command):
        p = add_config_args(sub.add_parser(stage.command, help=stage.description))
        p.add_argument("--force", action="store_true")
        p.set_defaults(func=_forward, entry=stage.cli)


def _forward(args: argparse.Namespace) -> int:
    """Call the ``main`` of ``python -m <args.entry>`` with the config arguments of this command."""
    argv = ["--config", str(args.config)] if args.config else ["--preset", args.preset]
    argv += [f"--set={o}" for o in args.overrides] + (["--force"] if args.force else [])
    entry_point(args.entry)(argv)
    return 0


def entry_point(module: str):
    """The ``main(argv)`` that ``python -m <module>`` runs: the module's own, or for a package (eagle3.export)
    its ``__main__``'s. Each command that hands over to a stage's command line names that module as ``entry``."""
    import importlib

    found = importlib.import_module(module)
    if not hasattr(found, "main") and hasattr(found, "__path__"):
        found = importlib.import_module(f"{module}.__main__")
    return found.main


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `eagle3` console script."""
    args = build_parser().parse_args(argv)
    sys.exit(exit_on_user_error(args.func)(args))


if __name__ == "__main__":
    main()
