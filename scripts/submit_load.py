"""Submissions from the UI's Run form while a pipeline runs (issue 39, list 1, item 1): how many fail?

    .venv/bin/python scripts/submit_load.py                  # 60 submissions, 4 at a time, tiny pipeline busy
    .venv/bin/python scripts/submit_load.py -n 100 -c 6 --env PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED=false
    .venv/bin/python scripts/submit_load.py --database "$(scripts/postgres.sh url)"

A lab/ops script, not a test. It starts the local server the way `eagle3 server start` does
(flows.local_server.start, so with the environment flows.local_server builds) in a temporary workdir on its
own port, registers the deployments (`eagle3 setup --no-workers`), keeps `eagle3 run --preset tiny --force`
running in a subprocess (so the database is busy), and then POSTs what the UI's Run form sends,
`POST /api/deployments/{id}/create_flow_run` with the deployment's parameters, N times with raw httpx, C at a
time, with NO retries (the UI does not retry). It prints the count of non-2xx answers, their codes, the
latency and the server log lines that say `locked`. Exit status: 1 when any submission failed.

--env KEY=VALUE (repeatable) goes into the server's environment on top of what flows.local_server sets, to
try a setting before it goes into flows/local_server.py; --baseline drops the settings local_server adds for
SQLite (local_server.SQLITE_ENV: BEGIN IMMEDIATE), to measure Prefect's defaults.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flows import local_server  # noqa: E402

DEPLOYMENT = "eagle3-pipeline/eagle3-pipeline"


def _pipeline_loop(env: dict[str, str], workdir: Path, stop: threading.Event, log: Path, counts: dict) -> None:
    """`eagle3 run --preset tiny --force` again and again until stop is set (the busy database)."""
    eagle3 = str(Path(sys.executable).with_name("eagle3"))
    with log.open("ab") as out:
        while not stop.is_set():
            proc = subprocess.Popen(
                [eagle3, "run", "--preset", "tiny", "--force", "--no-progress", "--set", f"run.workdir={workdir}"],
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            while proc.poll() is None:
                if stop.wait(0.5):
                    proc.terminate()
                    proc.wait(30)
                    return
            counts["pipelines"] += 1
            counts["pipeline_rc"].append(proc.returncode)


def _wait_pipeline_busy(api: str, timeout_s: float = 240.0) -> None:
    """Until a flow run of the pipeline is RUNNING (its tasks write to the database from then on)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = httpx.post(
            f"{api}/flow_runs/filter",
            json={"flow_runs": {"state": {"type": {"any_": ["RUNNING"]}}}, "limit": 1},
            timeout=30,
        )
        if r.status_code == 200 and r.json():
            return
        time.sleep(1.0)
    raise TimeoutError("no pipeline flow run became RUNNING")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--submissions", type=int, default=60)
    ap.add_argument("-c", "--concurrency", type=int, default=4)
    ap.add_argument("--port", type=int, default=4331)
    ap.add_argument("--database", help="a PostgreSQL URL (postgresql+asyncpg://...) instead of SQLite")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra server environment")
    ap.add_argument("--baseline", action="store_true", help="without local_server's SQLite settings")
    ap.add_argument("--keep", action="store_true", help="keep the temporary workdir")
    args = ap.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="submit-load-"))
    server = local_server.for_workdir(workdir, args.port, args.database)
    if args.baseline:
        server = local_server.LocalServer(server.home, server.port, server.database_url, sqlite_settings=False)
    extra = dict(kv.split("=", 1) for kv in args.env)
    # the 503s' cause in the server log (Prefect logs retryable errors only when asked); no effect on the answers
    os.environ["PREFECT_SERVER_LOG_RETRYABLE_ERRORS"] = "true"
    os.environ.update(extra)  # start() passes os.environ on, under local_server's own settings
    prefixes = ("PREFECT_SERVER_DATABASE", "PREFECT_SERVER_SERVICES", "EAGLE3_SQLITE")
    shown = {k: local_server.mask_password(v) for k, v in server.server_env().items() if k.startswith(prefixes)}
    print(f"workdir {workdir}\nserver settings: {shown | extra or 'Prefect defaults'}", flush=True)
    t0 = time.monotonic()
    local_server.start(server)
    print(f"server started in {time.monotonic() - t0:.1f} s ({server.database()})", flush=True)
    env = {**os.environ, **server.client_env(), "EAGLE3_WORKDIR": str(workdir), "EAGLE3_PREFECT_PORT": str(args.port)}
    stop = threading.Event()
    counts: dict = {"pipelines": 0, "pipeline_rc": []}
    loop = None
    try:
        eagle3 = str(Path(sys.executable).with_name("eagle3"))
        setup = subprocess.run(
            [eagle3, "setup", "--no-workers", "--workdir", str(workdir), "--port", str(args.port)],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if setup.returncode != 0:
            print(setup.stdout[-3000:], setup.stderr[-3000:], sep="\n")
            return 2
        api = server.api_url
        dep = httpx.get(f"{api}/deployments/name/{DEPLOYMENT}", timeout=30).json()
        print(f"deployment {DEPLOYMENT} {dep['id']} registered ({time.monotonic() - t0:.1f} s)", flush=True)

        loop = threading.Thread(target=_pipeline_loop, args=(env, workdir, stop, workdir / "pipeline.log", counts))
        loop.start()
        _wait_pipeline_busy(api)
        print(
            f"pipeline running ({time.monotonic() - t0:.1f} s); submitting {args.submissions}, "
            f"{args.concurrency} at a time",
            flush=True,
        )

        url = f"{api}/deployments/{dep['id']}/create_flow_run"
        results: list[tuple[int | str, float]] = []

        def submit(i: int) -> None:
            body = {
                "name": f"load-{i}",
                "parameters": dep.get("parameters") or {},
                "tags": [],
                "job_variables": {},
                "enforce_parameter_schema": True,
                "state": {"type": "SCHEDULED", "name": "Scheduled", "message": "Run from the Prefect UI"},
            }
            t = time.monotonic()
            try:
                with httpx.Client(timeout=httpx.Timeout(120.0)) as client:  # a browser tab waits, it does not retry
                    code: int | str = client.post(url, json=body).status_code
            except httpx.HTTPError as exc:
                code = type(exc).__name__
            results.append((code, time.monotonic() - t))

        t1 = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(submit, range(args.submissions)))
        wall = time.monotonic() - t1
    finally:
        stop.set()
        if loop:
            loop.join(60)
        local_server.stop(server)

    failed = [c for c, _ in results if not (isinstance(c, int) and 200 <= c < 300)]
    lat = sorted(s for _, s in results)
    codes: dict = {}
    for c in failed:
        codes[c] = codes.get(c, 0) + 1
    locked = [ln for ln in server.log_file.read_text(errors="replace").splitlines() if "locked" in ln]
    print(f"\nsubmissions: {len(results)} in {wall:.1f} s, failed (non-2xx): {len(failed)} {codes or ''}")
    print(
        f"latency s: median {statistics.median(lat):.2f}  p95 {lat[int(0.95 * (len(lat) - 1))]:.2f}  max {lat[-1]:.2f}"
    )
    print(
        f"pipelines during the load: {counts['pipelines']} finished (exit codes {counts['pipeline_rc']}), "
        f"one more stopped"
    )
    print(f"server log lines with 'locked': {len(locked)}")
    for ln in locked[:20]:
        print("  " + ln[:300])
    if args.keep:
        print(f"kept {workdir}")
    else:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
