"""Capture fanned out through Prefect: eagle3-capture with capture.num_slices=3 submits three eagle3-capture-slice
runs, three workers of the gpu pool ("hosts" with their own name and home) pick one each, and the parent
finalizes one complete capture. Slow (deploy, three workers, three flow-run processes loading the tiny target)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
from prefect.settings import PREFECT_API_URL

from deployments.setup import setup
from eagle3.config import load_config
from eagle3.run.stages import run_all
from flows.capture import eagle3_capture
from flows.follow import deploy
from flows.local_server import LocalServer
from infra.process import kill_group, spawn_detached

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
HOSTS = ("host-a", "host-b", "host-c")


def _start_host(tmp_path: Path, port: int, name: str) -> int:
    """A process worker of the gpu pool named ``name`` with a PREFECT_HOME of its own (one "host"); its pid.

    It polls every second, so all three take a slice run before any of those runs (seconds each) is over."""
    home = LocalServer(tmp_path / name, port)
    home.home.mkdir(parents=True)
    argv = [
        str(Path(sys.executable).with_name("prefect")),
        "worker",
        "start",
        "--pool",
        "gpu",
        "--name",
        name,
        "--limit",
        "1",
    ]
    env = {**os.environ, **home.client_env(), "PREFECT_WORKER_QUERY_SECONDS": "1"}
    return spawn_detached(argv, home.home / "worker.log", env=env, cwd=ROOT)


def _picked_by(tmp_path: Path) -> dict[str, str]:
    """Flow run id -> name of the worker that submitted it, from each worker's own log. Two workers may both try a
    run; the server lets one have it and the other logs "Aborted submission", which does not count."""
    found = {}
    for host in HOSTS:
        text = (tmp_path / host / "worker.log").read_text()
        aborted = set(re.findall(r"Aborted submission of flow run '([0-9a-f-]+)'", text))
        submitted = re.findall(r"Worker '([^']+)' submitting flow run '([0-9a-f-]+)'", text)
        found.update({run_id: name for name, run_id in submitted if run_id not in aborted})
    return found


def test_three_slices_on_three_workers_capture_every_shard_once(tmp_path):
    """Three slice runs complete, each picked up by a different worker; their shard lists are disjoint and cover
    the plan; the capture manifest lists every planned shard exactly once with the plan's token count."""
    setup()
    port = urlparse(PREFECT_API_URL.value()).port
    deploy(LocalServer(tmp_path / "deployer", port), ["eagle3-capture-slice"], ROOT)
    cfg = load_config(
        "tiny", [f"run.workdir={tmp_path / 'runs'}", "capture.num_slices=3", "capture.tokens_per_shard=1000"]
    )
    run_all(cfg)
    pids = [_start_host(tmp_path, port, name) for name in HOSTS]
    try:
        manifest = eagle3_capture(config=cfg)
    finally:
        for pid in pids:
            kill_group(pid, grace_s=15.0)
    fdir = cfg.run_dir / "features"
    plan = json.loads((fdir / "plan.json").read_text())
    planned = [s["index"] for s in plan["shards"]]
    assert len(planned) >= 3 and manifest["stats"]["num_shards"] == len(planned)
    assert manifest["stats"]["num_tokens"] == plan["num_tokens"]
    listed = json.loads((fdir / "capture.manifest.json").read_text())["outputs"]
    assert sorted(k for k in listed if k.startswith("shard-")) == [f"shard-{i:05d}" for i in planned]
    with get_client(sync_client=True) as client:
        deployment = client.read_deployments(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["eagle3-capture-slice"]))
        )[0]
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id={"any_": [deployment.id]}))
    assert sorted(r.name for r in runs) == [f"capture-tiny-slice{k}-try1" for k in range(3)]
    assert all(r.state.is_completed() for r in runs)
    sliced = [i for r in runs for i in r.parameters["shards"]]
    assert sorted(sliced) == planned, "every planned shard in exactly one slice"
    picked = _picked_by(tmp_path)
    assert sorted(picked[str(r.id)] for r in runs) == sorted(HOSTS), "each worker ran one slice"
