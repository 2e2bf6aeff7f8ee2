"""prefect.yaml deploys against a real (test-harness) server: every deployment, parameters, schedule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL

from deployments.setup import setup

ROOT = Path(__file__).resolve().parents[2]


def test_prefect_deploy_all_registers_every_deployment():
    """`prefect --no-prompt deploy --all` succeeds; deployments name a preset and carry the eagle3 tag."""
    setup()
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    prefect = str(Path(sys.executable).with_name("prefect"))
    proc = subprocess.run([prefect, "--no-prompt", "deploy", "--all"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with get_client(sync_client=True) as client:
        deployments = {d.name: d for d in client.read_deployments()}
    assert {"eagle3-pipeline", "eagle3-capture", "eagle3-train", "eagle3-data", "eagle3-deploy"} <= set(deployments)
    pipeline = deployments["eagle3-pipeline"]
    assert pipeline.parameters == {"preset": "smollm2-demo", "overrides": []}
    assert "eagle3" in pipeline.tags and pipeline.work_pool_name == "gpu"
    assert [s.schedule.cron for s in pipeline.schedules] == ["0 3 * * *"]
    assert pipeline.job_variables["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"
    preset_field = pipeline.parameter_openapi_schema["properties"]["preset"]
    assert {"tiny", "smollm2-demo", "llama31-8b", "kimi-k25"} <= set(preset_field["enum"])  # a choice in the UI form
    assert deployments["eagle3-data"].parameters["until"] == "vocab"
    deploy = deployments["eagle3-deploy"]
    assert deploy.parameters == {"preset": "smollm2-demo", "overrides": []} and deploy.work_pool_name == "gpu"
    assert deploy.entrypoint == "flows/deploy.py:eagle3_deploy" and deploy.global_concurrency_limit.limit == 1
    steps_field = deploy.parameter_openapi_schema["properties"]["steps"]
    assert "export" in json.dumps(steps_field) and "benchmark" in json.dumps(steps_field)  # a multi-choice in the UI
