"""The Run form under load, small version of scripts/form_load.py: 5 submissions in headless chromium while a tiny
pipeline runs (the full measurement: 50+ with smollm2-demo, docs/operations.md).

    .venv/bin/python -m pytest tests/browser/test_form_load.py -m slow
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed: .venv/bin/python -m pip install -e '.[browser]'"
)
if not (shutil.which("chromium") or shutil.which("chromium-browser")):
    pytest.skip(
        "no system chromium (Playwright's own browser download is unreachable): apt-get install -y chromium",
        allow_module_level=True,
    )

from scripts.form_load import processes_of  # noqa: E402  (imports playwright)

ROOT = Path(__file__).resolve().parents[2]
SUBMISSIONS = 5


def test_form_submissions_while_a_pipeline_runs_all_succeed_and_nothing_is_left_running(tmp_path):
    """5 Custom-run submissions from the form while a tiny pipeline runs: every one answered 2xx with the success
    toast and its run on the server with the form's override; afterwards no process of that server is left."""
    workdir = tmp_path / "w"
    cmd = [
        sys.executable,
        "scripts/form_load.py",
        "-n",
        str(SUBMISSIONS),
        "--preset",
        "tiny",
        "--workdir",
        str(workdir),
        "--json",
        str(tmp_path / "form_load.json"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "form_load.json").read_text())
    assert (report["submissions"], report["failed"]) == (SUBMISSIONS, 0), report["failure_reasons"]
    seen = report["submissions_seen"]
    assert all(s["status"] == 201 and s["toast"] == "scheduled" and s["appeared"] for s in seen), seen
    assert report["while_pipeline_running"] >= 1, seen
    assert processes_of(workdir / ".prefect") == []
