"""Regeneration fanned out through Prefect: the pipeline's regenerate step with regenerate.num_slices=3 submits three
eagle3-regenerate-slice runs, three workers of the gpu pool ("hosts" with their own name and home) pick one each,
and the parent writes one complete regeneration. Slow (deploy, three workers, three flow-run processes)."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.parquet as pq
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
from prefect.settings import PREFECT_API_URL

from deployments.setup import setup
from eagle3.config import load_config
from flows.follow import deploy
from flows.local_server import LocalServer
from flows.pipeline import eagle3_pipeline
from infra.process import kill_group
from tests.fakes.openai_server import FakeOpenAIServer
from tests.flows.test_capture_slices_slow import HOSTS, _picked_by, _start_host

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_three_slices_on_three_workers_answer_every_conversation_once(tmp_path):
    """Three slice runs complete, each picked up by a different worker; the three slices are disjoint and cover the
    input, no slice journal is left, and regenerated.parquet holds the fake's answer for every conversation."""
    setup()
    port = urlparse(PREFECT_API_URL.value()).port
    deploy(LocalServer(tmp_path / "deployer", port), ["eagle3-regenerate-slice"], ROOT)
    pids = [_start_host(tmp_path, port, name) for name in HOSTS]
    try:
        with FakeOpenAIServer(lifetime_s=600) as server:
            cfg = load_config(
                "tiny",
                [
                    f"run.workdir={tmp_path / 'runs'}",
                    "regenerate.enabled=true",
                    f"regenerate.endpoint={server.base_url}",
                    "regenerate.num_slices=3",
                ],
            )
            result = eagle3_pipeline(config=cfg, until="vocab")
    finally:
        for pid in pids:
            kill_group(pid, grace_s=15.0)
    data = cfg.run_dir / "data"
    rows = pq.read_table(data / "regenerated.parquet").to_pylist()
    slices = json.loads((data / "regenerate.slices.json").read_text())["slices"]
    assert len(slices) == 3 and sorted(i for s in slices for i in s) == sorted(r["id"] for r in rows)
    assert all(m["content"].startswith("answer to:") for r in rows for m in r["messages"] if m["role"] == "assistant")
    assert result["regenerate"]["stats"]["success"] == len(rows) and list(data.glob("*.slice-*.jsonl")) == []
    with get_client(sync_client=True) as client:
        deployment = client.read_deployments(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["eagle3-regenerate-slice"]))
        )[0]
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id={"any_": [deployment.id]}))
    assert sorted(r.name for r in runs) == [f"regenerate-tiny-slice{k}-try1" for k in range(3)]
    assert all(r.state.is_completed() for r in runs)
    assert sorted(r.parameters["index"] for r in runs) == [0, 1, 2]
    picked = _picked_by(tmp_path)
    assert sorted(picked[str(r.id)] for r in runs) == sorted(HOSTS), "each worker ran one slice"
