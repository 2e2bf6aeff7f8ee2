"""Sliced regeneration's parent under a real Prefect server, with the slice runs faked in-process: re-submission of
a Crashed slice only, refusal of a Cancelled one, outputs identical to a one-slice run, one progress artifact."""

from __future__ import annotations

import json

import pytest

import flows.regenerate as regenerate_flow
from eagle3.config import load_config
from eagle3.run.stages import is_complete, run_merge, run_regenerate, run_regenerate_slice
from flows.pipeline import eagle3_pipeline
from tests.fakes.openai_server import FakeOpenAIServer
from tests.fakes.slice_runs import fake_slice_runs


@pytest.fixture(scope="module")
def server():
    with FakeOpenAIServer(lifetime_s=600) as fake:
        yield fake


def _cfg(workdir, server, num_slices):
    return load_config(
        "tiny",
        [
            f"run.workdir={workdir}",
            "regenerate.enabled=true",
            f"regenerate.endpoint={server.base_url}",
            f"regenerate.num_slices={num_slices}",
        ],
    )


def _fake_slices(monkeypatch, outcome):
    """Fake slice runs (tests/fakes/slice_runs.py) that answer their slice; returns the submitted (name, index)."""
    return fake_slice_runs(
        monkeypatch,
        regenerate_flow.SLICE_DEPLOYMENT,
        outcome,
        lambda p: run_regenerate_slice(p["config"], p["index"]),
        lambda p: p["index"],
    )


def _progress(key: str, flow_run_id) -> list[float]:
    """The values of the progress artifacts under ``key`` that one flow run made."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])
            )
        )
    return [a.data for a in found]


def test_a_crashed_slice_is_submitted_again_and_the_output_equals_one_slice(tmp_path, server, monkeypatch):
    """Slice 1 crashes on its first run: only it is submitted again; the three slices are disjoint and cover
    the conversations; regenerated.parquet equals a one-slice run's (without Prefect) byte for byte, one progress
    artifact reached 100%, and with num_slices=1 the stage counts as complete (num_slices is not in its key)."""
    submitted = _fake_slices(monkeypatch, lambda name: "CRASHED" if name.endswith("slice1-try1") else "COMPLETED")
    cfg = _cfg(tmp_path / "three", server, 3)
    state = eagle3_pipeline(config=cfg, until="vocab", return_state=True)
    result = state.result()
    assert submitted == [
        ("regenerate-tiny-slice0-try1", 0),
        ("regenerate-tiny-slice1-try1", 1),
        ("regenerate-tiny-slice2-try1", 2),
        ("regenerate-tiny-slice1-try2", 1),
    ]
    data = cfg.run_dir / "data"
    slices = json.loads((data / "regenerate.slices.json").read_text())["slices"]
    ids = [json.loads(line)["id"] for line in (data / "regenerate.journal.jsonl").read_text().splitlines()]
    assert sorted(i for s in slices for i in s) == sorted(ids) and len(ids) == len(set(ids))
    assert result["regenerate"]["stats"]["success"] == len(ids) == result["regenerate"]["stats"]["input"]
    assert _progress("tiny-regenerate-progress", state.state_details.flow_run_id) == [100.0]

    one = _cfg(tmp_path / "one", server, 1)
    run_merge(one)
    assert run_regenerate(one).computed
    out = "data/regenerated.parquet"
    assert (tmp_path / "three" / "tiny" / out).read_bytes() == (tmp_path / "one" / "tiny" / out).read_bytes()
    assert is_complete(_cfg(tmp_path / "three", server, 1), "regenerate")


def test_a_cancelled_slice_stops_the_regeneration_without_a_manifest(tmp_path, server, monkeypatch):
    """A slice run that ends Cancelled is not submitted again, and no regenerate manifest is written."""
    submitted = _fake_slices(monkeypatch, lambda name: "CANCELLED" if "slice2" in name else "COMPLETED")
    cfg = _cfg(tmp_path, server, 3)
    with pytest.raises(RuntimeError, match="CANCELLED"):
        eagle3_pipeline(config=cfg, until="vocab")
    assert len(submitted) == 3
    assert not (cfg.run_dir / "data" / "regenerate.manifest.json").exists()
