"""prefect.yaml deploys against a real (test-harness) server: every deployment, parameters, schedule."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlparse

import yaml
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL

from flows.cli import setup_local
from flows.local_server import LocalServer

ROOT = Path(__file__).resolve().parents[2]


def test_setup_registers_every_deployment_and_says_how_to_serve_each_pool(tmp_path, capsys):
    """`eagle3 setup` registers every deployment of prefect.yaml (preset-named, eagle3-tagged) and, without
    starting workers, prints the command that starts one for each pool a deployment uses."""
    server = LocalServer(tmp_path / ".prefect", urlparse(PREFECT_API_URL.value()).port)
    pools = setup_local(server, start_workers=False)
    printed = capsys.readouterr().out
    in_yaml = {
        d["name"]: d["work_pool"]["name"] for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    }
    assert {"eagle3-pipeline", "eagle3-capture", "eagle3-train", "eagle3-data", "eagle3-deploy"} <= set(in_yaml)
    assert pools == {"gpu": [n for n, p in in_yaml.items() if p == "gpu"], "cpu": ["eagle3-data"]}
    for pool in pools:
        assert f"eagle3 worker start --pool {pool}" in printed
    with get_client(sync_client=True) as client:
        deployments = {d.name: d for d in client.read_deployments()}
    assert set(in_yaml) <= set(deployments)
    assert all(deployments[n].work_pool_name == p for n, p in in_yaml.items())
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
    for name, dep in deployments.items():
        if name in in_yaml:  # the UI form shows each parameter's description as its help text
            props = dep.parameter_openapi_schema["properties"]
            assert all(p.get("description") for p in props.values()), (name, props)
    assert "e.g." in deployments["eagle3-pipeline"].parameter_openapi_schema["properties"]["overrides"]["description"]
