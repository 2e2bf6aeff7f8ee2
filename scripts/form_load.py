"""Submissions through the UI's Run form, in headless chromium, while a pipeline runs (issue 39): how many fail?

    .venv/bin/python scripts/form_load.py                       # 50 submissions, smollm2-demo pipeline running
    .venv/bin/python scripts/form_load.py --baseline           # the server without local_server's SQLite settings
    .venv/bin/python scripts/form_load.py -n 5 --preset tiny --workdir W --json W/out.json   # tests/browser's

scripts/submit_load.py sends the form's request with httpx; this script clicks the form itself, so what it counts is
what a user sees. In a temporary workdir (or --workdir) on a free port it starts the local server as `eagle3 server
start` does (flows.local_server.start; --baseline: without local_server.SQLITE_ENV, Prefect's BEGIN DEFERRED), runs
`eagle3 setup` (pools, automations, deployments, a worker per pool), creates a run of the eagle3-pipeline deployment
(--preset) for the worker and waits until it is Running (the loaded machine). Then,
one after another as one user would, it opens the deployment's Custom run form in Playwright's chromium (Debian's
`chromium`), adds one override (`run.workdir=` a folder of the temporary workdir, so a submitted run that a worker
starts writes nowhere else), clicks Submit and records:

* the answer to `POST /api/deployments/{id}/create_flow_run` (page.on("response")), and any HTTP 5xx the page got
  from the API while it loaded or submitted (each shows the UI's "Oops. Something went wrong." toast);
* which toast came: "<run name> scheduled to start" or "Something went wrong ..." (none within the timeout also
  fails);
* the latency from the click to the create_flow_run answer; whether a pipeline was Running right after.

A submission succeeded when the answer was 2xx, the success toast came, no error toast or 5xx came, and the run is
on the server under its name with the override. Then it prints a table (submissions, succeeded, failed, reasons,
latency), cancels and deletes every flow run on that server (the submitted runs queue behind the pipeline: the
deployment runs one at a time), stops the workers and the server (`eagle3 server stop`), ends any process left
that talks to that server, and removes the temporary workdir (--keep keeps it). Exit status 1 when any submission
failed. Figures: docs/operations.md ("Current figures"); runs: docs/log.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from playwright.sync_api import Page, Response, sync_playwright

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flows import local_server  # noqa: E402

DEPLOYMENT = "eagle3-pipeline/eagle3-pipeline"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ERROR_TEXT = "Something went wrong"  # the form's error toast and the UI's toast for an API 5xx both say it
SUBMIT_TIMEOUT_S = 180.0
FINAL_STATES = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass
class Submission:
    """One click of the form's Submit and what the user saw."""

    index: int
    name: str = ""
    status: int | None = None  # the create_flow_run answer's HTTP status (None: no answer)
    latency_s: float | None = None  # click -> create_flow_run answer
    toast: str = ""  # "scheduled", "error" or "" (none)
    server_errors: list[str] = field(default_factory=list)  # "503 POST /deployments/{id}/create_flow_run" seen
    appeared: bool = False  # the run is on the server under its name, with the form's override
    pipeline_running: bool = False  # a pipeline flow run was Running right after the submission
    load_1m: float = 0.0  # the machine's 1-minute load average right after the submission

    def reasons(self) -> list[str]:
        """Why this submission failed from the user's side (empty: it succeeded)."""
        reasons = [f"HTTP {e}" for e in self.server_errors]
        if self.status is None:
            reasons.append("no create_flow_run answer")
        elif not 200 <= self.status < 300 and not any(e.startswith(f"{self.status} POST") for e in self.server_errors):
            reasons.append(f"create_flow_run HTTP {self.status}")
        if self.toast == "error":
            reasons.append(f"toast '{ERROR_TEXT}'")
        elif self.toast == "":
            reasons.append("no toast")
        if not self.appeared and self.status is not None and 200 <= self.status < 300:
            reasons.append("run not on the server")
        return reasons


@dataclass(frozen=True)
class Local:
    """The workdir's server, as `eagle3 --workdir W --port P` addresses it."""

    workdir: Path
    port: int

    @property
    def ui(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, method: str, path: str, body: Any = None) -> Any:
        response = httpx.request(method, f"{self.ui}/api{path}", json=body, timeout=60)
        response.raise_for_status()
        return response.json() if response.content else None

    def eagle3(self, *args: str) -> str:
        """`eagle3 ARGS --workdir W --port P` as a user runs it; its output (RuntimeError on a non-zero exit)."""
        argv = [
            str(Path(sys.executable).with_name("eagle3")),
            *args,
            "--workdir",
            str(self.workdir),
            "--port",
            str(self.port),
        ]
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"eagle3 {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_pipeline(local: Local, deployment_id: str, preset: str, timeout_s: float = 600.0) -> str:
    """A run of the pipeline deployment (``preset``, in the workdir) for the worker; its id once it is Running."""
    params = {"preset": preset, "overrides": [f"run.workdir={local.workdir / 'pipeline-runs'}"]}
    run = local.api(
        "POST", f"/deployments/{deployment_id}/create_flow_run", {"name": "form-load-pipeline", "parameters": params}
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = local.api("GET", f"/flow_runs/{run['id']}")["state"]["type"]
        if state == "RUNNING":
            return run["id"]
        if state in FINAL_STATES:
            raise RuntimeError(f"the pipeline run ended {state} before the submissions began")
        time.sleep(2.0)
    raise TimeoutError(f"the pipeline run was not Running after {timeout_s:.0f} s")


def all_flow_runs(local: Local, body: dict[str, Any], page: int = 200) -> list[dict[str, Any]]:
    """Every flow run the filter ``body`` matches (the API answers at most 200 a call)."""
    runs: list[dict[str, Any]] = []
    while len(batch := local.api("POST", "/flow_runs/filter", {**body, "limit": page, "offset": len(runs)})) == page:
        runs += batch
    return runs + batch


def task_states(local: Local, run_id: str) -> str:
    """'name State, ...' of the flow run's task runs, oldest first (which stages ran while the form was used)."""
    body = {"flow_runs": {"id": {"any_": [run_id]}}, "sort": "EXPECTED_START_TIME_ASC", "limit": 200}
    return ", ".join(f"{t['name']} {t['state']['name']}" for t in local.api("POST", "/task_runs/filter", body))


def pipeline_running(local: Local) -> bool:
    running = {"flow_runs": {"state": {"type": {"any_": ["RUNNING"]}}}, "limit": 1}
    return bool(local.api("POST", "/flow_runs/filter", running))


def submit_form(page: Page, local: Local, deployment_id: str, override: str, index: int) -> Submission:
    """Open the Custom run form, add ``override``, click Submit; what came back (the page's responses, the toast)."""
    sub = Submission(index)

    def on_response(response: Response) -> None:
        if "/api/" in response.url and response.status >= 500:
            path = UUID.sub("{id}", response.url.split("/api", 1)[1])
            sub.server_errors.append(f"{response.status} {response.request.method} {path}")

    page.on("response", on_response)
    try:
        page.goto(f"{local.ui}/deployments/deployment/{deployment_id}/run")
        page.get_by_role("button", name="Add item").click()
        page.locator(".schema-form-property-array-item textarea").last.fill(override)
        sub.name = page.locator("input").first.input_value()  # the form's Run Name (a generated one)
        t0 = time.monotonic()
        with page.expect_response(
            lambda r: r.url.endswith("/create_flow_run") and r.request.method == "POST", timeout=SUBMIT_TIMEOUT_S * 1000
        ) as answer:
            page.get_by_role("button", name="Submit").click()
        sub.status, sub.latency_s = answer.value.status, time.monotonic() - t0
        sub.toast = wait_toast(page, sub.name)
    except Exception as exc:  # a page that never rendered, a click that sent nothing: the user saw it fail
        sub.server_errors.append(f"page: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    finally:
        page.remove_listener("response", on_response)
    return sub


def wait_toast(page: Page, name: str) -> str:
    """'scheduled' or 'error', whichever toast shows first; '' when none shows within the timeout."""
    scheduled = page.get_by_text(f"{name} scheduled to start")
    error = page.get_by_text(ERROR_TEXT)
    try:
        scheduled.or_(error).first.wait_for(timeout=60_000)
    except Exception:
        return ""
    return "error" if error.count() else "scheduled"


def record_appeared(local: Local, subs: list[Submission], override: str) -> None:
    """Mark the submissions whose run the server holds under its name, with the override the form was given."""
    names = [s.name for s in subs if s.name]
    runs = all_flow_runs(local, {"flow_runs": {"name": {"any_": names}}})
    found = {r["name"] for r in runs if override in (r["parameters"].get("overrides") or [])}
    for sub in subs:
        sub.appeared = sub.name in found


def submit_all(local: Local, deployment_id: str, count: int, override: str) -> list[Submission]:
    """``count`` form submissions, one after another, in one headless chromium tab."""
    subs = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(120_000)
            for i in range(count):
                sub = submit_form(page, local, deployment_id, override, i)
                sub.pipeline_running, sub.load_1m = pipeline_running(local), os.getloadavg()[0]
                subs.append(sub)
                print(
                    f"{i + 1:3d}/{count} {sub.name or '-':28s} HTTP {sub.status} {sub.latency_s or 0:6.2f} s "
                    f"{sub.toast or 'no toast':9s} pipeline {'running' if sub.pipeline_running else 'not running'} "
                    f"load {sub.load_1m:.1f}"
                    f"{'  ' + '; '.join(sub.server_errors) if sub.server_errors else ''}",
                    flush=True,
                )
        finally:
            browser.close()
    record_appeared(local, subs, override)
    return subs


def summary(subs: list[Submission]) -> dict[str, Any]:
    """The table's figures."""
    failed = [s for s in subs if s.reasons()]
    reasons: dict[str, int] = {}
    for sub in failed:
        for reason in sub.reasons():
            reasons[reason] = reasons.get(reason, 0) + 1
    latencies = sorted(s.latency_s for s in subs if s.latency_s is not None)
    return {
        "submissions": len(subs),
        "succeeded": len(subs) - len(failed),
        "failed": len(failed),
        "failure_reasons": reasons,
        "while_pipeline_running": sum(s.pipeline_running for s in subs),
        "load_1m_median": round(statistics.median(s.load_1m for s in subs), 1) if subs else None,
        "latency_median_s": round(statistics.median(latencies), 2) if latencies else None,
        "latency_max_s": round(latencies[-1], 2) if latencies else None,
    }


def print_table(figures: dict[str, Any]) -> None:
    reasons = "; ".join(f"{k} x{v}" for k, v in figures["failure_reasons"].items()) or "-"
    rows = [
        ("submissions, one after another", f"{figures['submissions']} in {figures['wall_s']} s"),
        ("succeeded", figures["succeeded"]),
        ("failed", figures["failed"]),
        ("failure reasons", reasons),
        ("made while a pipeline was Running", figures["while_pipeline_running"]),
        ("1-minute load average, median over the submissions", figures["load_1m_median"]),
        (
            "submit latency median / max (click -> create_flow_run answer)",
            f"{figures['latency_median_s']} / {figures['latency_max_s']} s",
        ),
    ]
    print("\n| figure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


def cancel_and_delete(local: Local, wait_s: float = 180.0) -> int:
    """Cancel every unfinished flow run on the server (the worker ends a running one), then delete every run."""
    runs = all_flow_runs(local, {})
    for run in runs:
        state = run["state"]["type"] if run["state"] else "SCHEDULED"
        if state not in FINAL_STATES:
            target = "CANCELLING" if state in ("RUNNING", "PENDING") else "CANCELLED"
            local.api("POST", f"/flow_runs/{run['id']}/set_state", {"state": {"type": target}, "force": True})
    deadline = time.monotonic() + wait_s
    cancelling = {"flow_runs": {"state": {"type": {"any_": ["CANCELLING"]}}}}
    while local.api("POST", "/flow_runs/filter", cancelling) and time.monotonic() < deadline:
        time.sleep(2.0)
    for run in runs:
        httpx.delete(f"{local.ui}/api/flow_runs/{run['id']}", timeout=60)
    return len(runs)


def processes_of(home: Path) -> list[int]:
    """Processes (other than this one) whose environment names ``home`` as PREFECT_HOME: what this script started."""
    marker = f"PREFECT_HOME={home.resolve()}".encode() + b"\0"
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if marker in (proc / "environ").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def end_processes(pids: list[int], grace_s: float = 10.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.2)


@contextmanager
def loaded_server(workdir: Path, port: int, preset: str, baseline: bool) -> Iterator[tuple[Local, str]]:
    """The server with the setup applied and a pipeline Running; (server, deployment id). Everything it started is
    cancelled, deleted and stopped on the way out. ``baseline``: without local_server.SQLITE_ENV."""
    local = Local(workdir, port)
    t0 = time.monotonic()
    server = local_server.for_workdir(workdir, port)  # what `eagle3 server start --workdir W --port P` starts
    os.environ["PREFECT_SERVER_LOG_RETRYABLE_ERRORS"] = "true"  # a 503's cause in the server log; answers unchanged
    try:
        local_server.start(local_server.LocalServer(server.home, port, sqlite_settings=not baseline))
        print(
            f"server started ({'without' if baseline else 'with'} {local_server.SQLITE_ENV}) in "
            f"{time.monotonic() - t0:.1f} s",
            flush=True,
        )
        local.eagle3("setup")
        deployment_id = local.api("GET", f"/deployments/name/{DEPLOYMENT}")["id"]
        run_id = start_pipeline(local, deployment_id, preset)
        print(
            f"setup applied, pipeline run {local.ui}/runs/flow-run/{run_id} ({preset}) Running after "
            f"{time.monotonic() - t0:.0f} s; load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        yield local, deployment_id
        print(f"the pipeline's tasks by then: {task_states(local, run_id)}", flush=True)
    finally:
        try:
            print(f"cleanup: {cancel_and_delete(local)} flow runs cancelled and deleted", flush=True)
        except httpx.HTTPError as exc:
            print(f"cleanup: the server did not answer ({exc}); stopping it", flush=True)
        try:
            print(local.eagle3("server", "stop").strip(), flush=True)
        finally:
            left = processes_of(workdir / ".prefect")
            if left:
                print(f"cleanup: ending {len(left)} processes left behind: {left}", flush=True)
                end_processes(left)


def locked_lines(workdir: Path) -> list[str]:
    log = workdir / ".prefect" / "server.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    return [line for line in text.splitlines() if "locked" in line or " 503 " in line or " 500 " in line]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--submissions", type=int, default=50)
    ap.add_argument("--preset", default="smollm2-demo", help="the pipeline run that loads the machine")
    ap.add_argument("--port", type=int, default=0, help="the server's port (0: a free one)")
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="the server without local_server's SQLite settings "
        "(Prefect's BEGIN DEFERRED transactions), to see what they change",
    )
    ap.add_argument("--json", type=Path, help="also write the figures and every submission here")
    ap.add_argument(
        "--workdir",
        type=Path,
        help="the server's and the runs' folder, kept (default: a temporary one, removed at the end)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the temporary workdir (server log, database)")
    args = ap.parse_args()
    if CHROMIUM is None:
        print("no chromium: apt-get install -y chromium", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so a killed measurement still cleans up
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="form-load-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"workdir {workdir}", flush=True)
    try:
        with loaded_server(workdir, args.port or free_port(), args.preset, args.baseline) as (local, deployment_id):
            override = f"run.workdir={workdir / 'form-runs'}"
            t0 = time.monotonic()
            subs = submit_all(local, deployment_id, args.submissions, override)
            wall_s = time.monotonic() - t0
        figures = summary(subs) | {"wall_s": round(wall_s, 1)}
        print_table(figures)
        errors = locked_lines(workdir)
        print(f"server log lines with 'locked', 500 or 503: {len(errors)}")
        for line, times in Counter(errors).most_common(10):
            print(f"  {times} x {line[:300]}")
        if args.json:
            args.json.write_text(
                json.dumps(
                    {**figures, "server_log_errors": errors[:50], "submissions_seen": [asdict(s) for s in subs]},
                    indent=2,
                )
            )
    finally:
        if args.keep or args.workdir:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if figures["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
