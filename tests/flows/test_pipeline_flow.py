"""The pipeline flow under a real Prefect server (prefect_test_harness): completion and skipping."""

from __future__ import annotations

import pytest

from eagle3.config import load_config
from flows.pipeline import eagle3_pipeline

STAGES = ("merge", "tokenize", "vocab")


def _tiny(tmp_path, *overrides: str):
    return load_config("tiny", [f"run.workdir={tmp_path}", *overrides])


def _computed(result: dict) -> dict[str, bool]:
    return {stage: result[stage]["computed"] for stage in STAGES}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("flow-runs")


def test_flow_completes_and_writes_every_output(workdir):
    """A first run completes and leaves merged, tokenized and vocab outputs plus config.json."""
    state = eagle3_pipeline(config=_tiny(workdir), until="vocab", return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert _computed(result) == {"merge": True, "tokenize": True, "vocab": True}
    run_dir = workdir / "tiny"
    for rel in (
        "config.json",
        "data/merged.parquet",
        "data/rejects.jsonl",
        "data/stats.json",
        "data/tokenized.parquet",
        "vocab/vocab_map.safetensors",
        "vocab/vocab_map.json",
    ):
        assert (run_dir / rel).is_file(), rel


def test_second_run_with_same_inputs_recomputes_nothing(workdir):
    """Re-running with identical inputs skips every stage and leaves the outputs untouched."""
    before = {p: p.stat().st_mtime_ns for p in (workdir / "tiny").rglob("*.parquet")}
    result = eagle3_pipeline(config=_tiny(workdir), until="vocab")
    assert _computed(result) == {"merge": False, "tokenize": False, "vocab": False}
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_changed_tokenize_config_recomputes_only_downstream(workdir):
    """Changing tokenize.max_len recomputes tokenize and vocab but not merge."""
    result = eagle3_pipeline(config=_tiny(workdir, "tokenize.max_len=64"), until="vocab")
    assert _computed(result) == {"merge": False, "tokenize": True, "vocab": True}


def test_changed_vocab_size_recomputes_only_vocab(workdir):
    """Changing the draft vocab size recomputes the vocab map alone."""
    result = eagle3_pipeline(config=_tiny(workdir, "tokenize.max_len=64", "vocab.draft_vocab_size=64"), until="vocab")
    assert _computed(result) == {"merge": False, "tokenize": False, "vocab": True}


def test_deleted_output_is_recomputed_despite_prefect_cache(workdir):
    """A stage whose output file vanished runs again even though Prefect holds a cached result."""
    cfg = _tiny(workdir, "tokenize.max_len=64", "vocab.draft_vocab_size=64")
    (workdir / "tiny" / "vocab" / "vocab_map.safetensors").unlink()
    result = eagle3_pipeline(config=cfg, until="vocab")
    assert _computed(result) == {"merge": False, "tokenize": False, "vocab": True}
    assert (workdir / "tiny" / "vocab" / "vocab_map.safetensors").is_file()


def test_flow_accepts_preset_and_overrides_as_parameters(workdir):
    """Deployments pass a preset name and dotted overrides, not a copy of the preset."""
    result = eagle3_pipeline(preset="tiny", overrides=[f"run.workdir={workdir}", "run.name=by-preset"], until="vocab")
    assert result["run_dir"].endswith("by-preset")
    assert _computed(result) == {"merge": True, "tokenize": True, "vocab": True}


def test_flow_with_regeneration_against_the_fake_openai_server(tmp_path):
    """With regeneration on, the flow re-answers through an OpenAI-compatible endpoint (a named fake here)
    and tokenizes the regenerated answers, not the dataset's."""
    import pyarrow.parquet as pq

    from tests.fakes.openai_server import FakeOpenAIServer

    with FakeOpenAIServer() as server:
        cfg = _tiny(
            tmp_path,
            "regenerate.enabled=true",
            f"regenerate.endpoint={server.base_url}",
            "regenerate.max_conversations=5",
        )
        result = eagle3_pipeline(config=cfg, until="vocab")
    stats = result["regenerate"]["stats"]
    assert (
        stats["success"] == 5
        and stats["success"] + stats["error"] + stats["skipped_done"] + stats["skipped_limit"] == stats["input"]
    )
    rows = pq.read_table(tmp_path / "tiny" / "data" / "regenerated.parquet").to_pylist()
    answers = [m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant"]
    assert sum(a.startswith("answer to:") for a in answers) >= 5
    assert result["tokenize"]["computed"] and result["vocab"]["computed"]


def test_merge_keeping_no_rows_fails_its_task_with_the_reason(tmp_path):
    """A binary file forced to sharegpt keeps 0 rows: the merge task run fails with the reason and the flow stops."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    blob = tmp_path / "blob.bin"
    blob.write_bytes(bytes(range(256)) * 8)
    cfg = _tiny(tmp_path, f"data.sources.0.path={blob}", "data.sources.0.format=sharegpt")
    state = eagle3_pipeline(config=cfg, until="vocab", return_state=True)
    assert state.is_failed()
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[state.state_details.flow_run_id]))
        )
    merge = [r for r in runs if r.name.startswith("merge")]
    assert len(merge) == 1 and merge[0].state.is_failed()
    assert "merge kept 0 of" in merge[0].state.message and "data.min_rows=1" in merge[0].state.message
    assert not [r for r in runs if r.name.startswith(("tokenize", "vocab"))]
