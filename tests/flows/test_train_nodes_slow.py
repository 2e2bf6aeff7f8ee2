"""Multi-node training through Prefect: eagle3-train with train.nnodes=2 submits two eagle3-train-node runs, two
workers of the gpu pool ("hosts" with their own name and home) pick one each, and their torchruns form one world.
Slow (~1 min on 2 cores: deploy, two workers, two flow-run processes, torchrun)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
from prefect.settings import PREFECT_API_URL

from deployments.setup import setup
from eagle3.train.metrics import read_metrics
from flows.follow import deploy
from flows.local_server import LocalServer
from flows.train import eagle3_train
from infra.process import kill_group, spawn_detached
from tests.unit.test_train_helpers import load_run_config, real_tiny_run
from tests.unit.test_train_multinode import TRAIN, _free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _start_host(tmp_path: Path, port: int, name: str) -> int:
    """A process worker of the gpu pool named ``name`` with a PREFECT_HOME of its own (one "host"); its pid."""
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
    return spawn_detached(argv, home.home / "worker.log", env={**os.environ, **home.client_env()}, cwd=ROOT)


def test_two_node_runs_on_two_workers_train_one_world(tmp_path):
    """Both node runs complete, each on its own worker; node 0 ran global rank 0 of a world of 2; 6 steps logged."""
    setup()
    port = urlparse(PREFECT_API_URL.value()).port
    deploy(LocalServer(tmp_path / "deployer", port), ["eagle3-train-node"], ROOT)
    cfg = load_run_config(
        real_tiny_run(tmp_path / "runs", [*TRAIN, "train.nnodes=2", f"train.rdzv_endpoint=127.0.0.1:{_free_port()}"])
    )
    pids = [_start_host(tmp_path, port, name) for name in ("host-a", "host-b")]
    try:
        summary = eagle3_train(config=cfg)
    finally:
        for pid in pids:
            kill_group(pid, grace_s=15.0)
    assert summary["manifest"] and len(read_metrics(cfg.run_dir / "train" / "metrics.jsonl", "train")) == 6
    with get_client(sync_client=True) as client:
        deployment = client.read_deployments(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["eagle3-train-node"]))
        )[0]
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id={"any_": [deployment.id]}))
    names = {r.name: r for r in runs}
    assert sorted(names) == ["train-tiny-node0-try1", "train-tiny-node1-try1"]
    assert all(r.state.is_completed() for r in runs)
    assert {r.parameters["node_rank"] for r in runs} == {0, 1}
    logs = {rank: (cfg.run_dir / "train" / f"torchrun.node{rank}.log").read_text() for rank in (0, 1)}
    # One world of 2: the node whose process got global rank 0 (c10d hands ranks out in joining order, so it may
    # be either node) logs the world and the steps; the other node's process never logs as rank 0.
    leader = [node for node in (0, 1) if "[rank 0] step " in logs[node]]
    assert len(leader) == 1 and "world 2" in logs[leader[0]] and "[rank 0]" not in logs[1 - leader[0]]
    worker_logs = [(tmp_path / h / "worker.log").read_text() for h in ("host-a", "host-b")]
    assert all("train-tiny-node" in text for text in worker_logs), "each worker ran one node"
