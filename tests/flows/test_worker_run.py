"""The demo's path: prefect deploy -> a background process worker -> run_deployment -> followed to the end."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from prefect.settings import PREFECT_API_URL

from deployments.setup import setup
from eagle3.config import load_config
from flows.follow import deploy, follow, trigger
from flows.local_server import LocalServer
from flows.local_worker import LocalWorker, start_worker, stop_worker, worker_pid
from flows.report import results_from_disk

ROOT = Path(__file__).resolve().parents[2]


def test_deployment_run_through_a_worker_completes_and_its_results_are_read_back(tmp_path, capsys):
    """A run triggered by deployment name executes in a worker's subprocess; follow() sees Completed."""
    setup()
    server = LocalServer(tmp_path / ".prefect", urlparse(PREFECT_API_URL.value()).port)
    assert server.api_url == PREFECT_API_URL.value().rstrip("/")
    deploy(server, ["eagle3-pipeline"], ROOT)
    worker = LocalWorker(server, "gpu")
    overrides = [f"run.workdir={tmp_path}", "run.name=via-worker"]
    try:
        assert start_worker(worker, ROOT) == "started" and start_worker(worker, ROOT) == "reused"
        run_id = trigger(
            "eagle3-pipeline/eagle3-pipeline", {"preset": "tiny", "overrides": overrides, "until": "vocab"}
        )
        final = follow(run_id, poll_s=1.0, timeout_s=240)
    finally:
        stop_worker(worker)
    assert final.state.type.value == "COMPLETED", final.state.message
    assert worker_pid(worker) is None
    printed = capsys.readouterr().out
    assert "merge-via-worker" in printed and "Completed" in printed  # task lines were shown while following
    results = results_from_disk(load_config("tiny", overrides))
    assert {"merge", "tokenize", "vocab"} <= set(results) and "capture" not in results
    assert results["vocab"]["stats"]["draft_vocab_size"] == 128
