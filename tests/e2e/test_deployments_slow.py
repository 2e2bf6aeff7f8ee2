"""Every deployment of prefect.yaml, started through the API the UI's "Custom run" form uses, on the tiny preset.

`eagle3 setup` registers the deployments and starts a process worker per work pool on a private local
server; each deployment is then run as a user would start it from the form (a flow run created from the
deployment with the form's parameters: a preset and dotted overrides), and must reach a worker and
complete. Order: data only, the whole pipeline, then capture, train and deploy again (each finds its
inputs and skips or redoes only what is missing).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.e2e.test_main_path import ROOT, _eagle3, _free_port

pytestmark = pytest.mark.slow

ORDER = (
    ("eagle3-pipeline/eagle3-data", {"until": "vocab"}),
    ("eagle3-pipeline/eagle3-pipeline", {"until": "evaluate"}),
    ("eagle3-capture/eagle3-capture", {}),
    ("eagle3-train/eagle3-train", {}),
    ("eagle3-deploy/eagle3-deploy", {}),
)


def test_each_deployment_reaches_a_worker_and_completes(tmp_path):
    """Runs created from each registered deployment with form parameters are picked up and end Completed."""
    port = _free_port()
    env = {**os.environ, "EAGLE3_PREFECT_PORT": str(port), "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)
    try:
        proc = _eagle3("setup", "--workdir", str(tmp_path), "--port", str(port), timeout=600, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        script = (
            "import sys, json, time\n"
            "from flows.follow import trigger, follow\n"
            "for name, extra in json.loads(sys.argv[1]):\n"
            "    t0 = time.monotonic()\n"
            "    params = {'preset': 'tiny', 'overrides': [f'run.workdir={sys.argv[2]}'], **extra}\n"
            "    run = follow(trigger(name, params), poll_s=2.0, timeout_s=900)\n"
            "    print(f'DEPLOYMENT {name} {run.state.type.value} {time.monotonic() - t0:.1f}s', flush=True)\n"
        )
        import json

        client_env = {**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-c", script, json.dumps(ORDER), str(tmp_path)],
            cwd=ROOT,
            env=client_env,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        out = proc.stdout + proc.stderr
        done = [line for line in out.splitlines() if line.startswith("DEPLOYMENT ")]
        print("\n".join(done), f"\nall deployments: {time.monotonic() - started:.1f} s")
        assert proc.returncode == 0, out[-5000:]
        assert [line.split()[1:3] for line in done] == [[name, "COMPLETED"] for name, _ in ORDER], out[-5000:]
    finally:
        _eagle3("server", "stop", "--workdir", str(tmp_path), "--port", str(port), timeout=120, env=env)
