"""The Prefect UI as a user drives it, in headless Debian chromium through Playwright, against a real local server
with the project's setup applied (`eagle3 server start` + `eagle3 setup`: pools, automations, deployments, a worker
per pool): a run submitted from the deployment's Custom run form, watched on its own page until Completed, and a
schedule switched on in the UI that a second `eagle3 setup` leaves on.

    .venv/bin/python -m pip install -e ".[browser]" && apt-get install -y chromium
    .venv/bin/python -m pytest tests/browser -m slow

Playwright cannot download its own browser here; it launches the system chromium (``executable_path``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.postgres import free_port

pytestmark = pytest.mark.slow
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed: .venv/bin/python -m pip install -e '.[browser]'"
)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip(
        "no system chromium (Playwright's own browser download is unreachable): apt-get install -y chromium",
        allow_module_level=True,
    )

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENT = "eagle3-pipeline"
RUN_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Server:
    """The local server of a test workdir, as `eagle3 --workdir W --port P` addresses it."""

    workdir: Path
    port: int

    @property
    def ui(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """One call of the server's REST API (what the UI itself calls)."""
        response = httpx.request(method, f"{self.ui}/api{path}", json=body, timeout=30)
        response.raise_for_status()
        return response.json()

    def deployment_id(self) -> str:
        return next(d["id"] for d in self.api("POST", "/deployments/filter", {}) if d["name"] == DEPLOYMENT)


def eagle3(server: Server, *args: str) -> str:
    """`eagle3 ARGS --workdir W --port P` as a user runs it; its output (fails the test on a non-zero exit)."""
    script = Path(sys.executable).with_name("eagle3")
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "flows.cli"]
    proc = subprocess.run(
        [*argv, *args, "--workdir", str(server.workdir), "--port", str(server.port)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"eagle3 {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    """A fresh local server with `eagle3 setup` applied; stopped with its workers at the end."""
    local = Server(tmp_path_factory.mktemp("ui"), free_port())
    eagle3(local, "server", "start")
    try:
        eagle3(local, "setup")
        yield local
    finally:
        eagle3(local, "server", "stop")


@pytest.fixture(scope="module")
def page(server) -> Iterator[Any]:
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        tab = browser.new_page(viewport={"width": 1400, "height": 1000})
        tab.set_default_timeout(60_000)
        yield tab
        browser.close()


def choose(page: Any, current: str, option: str) -> None:
    """Pick ``option`` in the form's drop-down that shows ``current`` (the UI's select opens on the keyboard)."""
    page.get_by_role("button", name=current, exact=True).focus()
    page.keyboard.press(" ")
    page.locator(".p-select-option").get_by_text(option, exact=True).click()


def submit_custom_run(page: Any, server: Server, overrides: list[str]) -> str:
    """Fill the deployment's Custom run form (preset tiny, ``overrides``), submit it and wait for the UI's
    confirmation; returns the address of the run's page."""
    page.goto(f"{server.ui}/deployments/deployment/{server.deployment_id()}/run")
    choose(page, "smollm2-demo", "tiny")
    for override in overrides:
        page.get_by_role("button", name="Add item").click()
        page.locator(".schema-form-property-array-item textarea").last.fill(override)
    name = page.locator("input").first.input_value()  # the form's Run Name (a generated one)
    page.get_by_role("button", name="Submit").click()
    page.get_by_text(f"{name} scheduled to start").first.wait_for()  # the UI's toast: the server took it
    (run,) = server.api("POST", "/flow_runs/filter", {"flow_runs": {"name": {"any_": [name]}}})
    return f"{server.ui}/runs/flow-run/{run['id']}"


def progress_cards(page: Any) -> dict[str, str]:
    """{key: description} of the progress artifacts on the run page's Artifacts tab."""
    page.get_by_text("Artifacts", exact=True).first.click()
    page.wait_for_timeout(1500)
    cards: dict[str, str] = {}
    lines = [line.strip() for line in page.locator("body").inner_text().splitlines()]
    for i, line in enumerate(lines[:-4]):
        if line == "PROGRESS":  # a card reads: PROGRESS, key, "Created", date, description
            cards[lines[i + 1]] = lines[i + 4]
    return cards


def watch_run(page: Any, run_url: str, timeout_s: float) -> tuple[list[str], dict[str, str], str]:
    """Reload the run's page every few seconds until its state badge says a final state; returns the states seen
    in order, the progress artifacts seen while it ran (key -> description) and the final state."""
    states: list[str] = []
    seen_running: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        page.goto(run_url)
        state = page.locator(".state-badge").first.inner_text().strip()
        if not states or states[-1] != state:
            states.append(state)
        if state in ("Completed", "Failed", "Crashed", "Cancelled"):
            return states, seen_running, state
        if state == "Running":
            seen_running.update(progress_cards(page))
        page.wait_for_timeout(3000)
    raise AssertionError(f"{run_url} not finished after {timeout_s:.0f} s; states seen: {states}")


def test_a_run_submitted_from_the_form_is_watched_to_completion_on_its_page(server, page):
    """Custom run of eagle3-pipeline from the form (preset tiny): the run page shows it Running with progress
    artifacts moving, then Completed with every stage's progress done."""
    workdir = server.workdir / "runs"
    run_url = submit_custom_run(page, server, [f"run.workdir={workdir}", "run.name=ui-run"])
    states, while_running, final = watch_run(page, run_url, RUN_TIMEOUT_S)
    assert final == "Completed", f"states seen on the run page: {states}"
    assert "Running" in states, states
    assert any(key.startswith("ui-run-") for key in while_running), f"no progress artifact while Running: {states}"
    done = progress_cards(page)
    assert "ui-run-train-progress" in done, sorted(done)
    assert (workdir / "ui-run" / "export").is_dir()  # the run the form submitted wrote where its overrides said


def test_a_schedule_switched_on_in_the_ui_stays_on_after_setup(server, page):
    """The nightly schedule's switch on the deployment page turned on, then `eagle3 setup` run again: the switch
    and the server's schedule are still on, and setup says it kept it."""
    deployment_id = server.deployment_id()
    page.goto(f"{server.ui}/deployments/deployment/{deployment_id}")
    switch = page.locator(".deployment-schedule-card [role=switch]").first
    assert switch.get_attribute("aria-checked") == "false"
    switch.click()
    page.wait_for_function(
        "() => document.querySelector('.deployment-schedule-card [role=switch]')"
        ".getAttribute('aria-checked') === 'true'"
    )
    deadline = time.monotonic() + 30
    while not all(s["active"] for s in server.api("GET", f"/deployments/{deployment_id}/schedules")):
        assert time.monotonic() < deadline, "the UI's switch did not reach the server"
        time.sleep(0.5)
    out = eagle3(server, "setup")
    assert "kept schedule 0 3 * * * UTC as it is (on)" in out, out
    schedules = server.api("GET", f"/deployments/{deployment_id}/schedules")
    assert [s["active"] for s in schedules] == [True], json.dumps(schedules)
    page.reload()
    assert page.locator(".deployment-schedule-card [role=switch]").first.get_attribute("aria-checked") == "true"
