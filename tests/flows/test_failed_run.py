"""A failed run says why where the user looks: CLI, follow view and the run-summary artifact (real Prefect runs)."""

from __future__ import annotations

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

from eagle3.config import load_config
from flows.pipeline import eagle3_pipeline

MISSING = "/nonexistent/chats-for-failure-test.jsonl"


def _failing_cfg(workdir, name: str):
    """The tiny preset whose only source file does not exist: the merge stage raises."""
    return load_config("tiny", [f"run.workdir={workdir}", f"run.name={name}", f"data.sources.0.path={MISSING}"])


def _artifacts(flow_run_id, key: str | None = None) -> list:
    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
                **({"key": ArtifactFilterKey(any_=[key])} if key else {}),
            )
        )


@pytest.fixture(scope="module")
def failed_state(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("failed-run")
    return eagle3_pipeline(config=_failing_cfg(workdir, "broken"), until="vocab", return_state=True)


def test_failed_pipeline_writes_a_run_summary_naming_stage_and_error(failed_state):
    """The run-summary artifact of a failed run names the failed stage, the exception type and its message."""
    assert failed_state.is_failed()
    (summary,) = _artifacts(failed_state.state_details.flow_run_id, "broken-run-summary")
    assert "failed" in summary.description
    assert "Failed at stage `merge`" in summary.data
    assert "SourceError" in summary.data and MISSING in summary.data
    assert "target:" in summary.data  # the stage before merge completed and is still reported
    table = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in summary.data.splitlines()
        if line.startswith("| ") and not line.startswith("| stage ")
    }
    assert list(table) == ["target", "merge", "tokenize", "vocab"]  # state, seconds, outputs, result, run
    assert table["target"][0] == "Completed" and table["merge"][0] == "Failed"
    assert float(table["merge"][1]) >= 0 and "/runs/task-run/" in table["merge"][4]
    assert table["tokenize"][:2] == ["Not started", ""] and table["vocab"][0] == "Not started"


def test_bad_override_fails_with_a_run_summary_saying_did_you_mean(tmp_path):
    """A pipeline run with an unknown override key fails, and still publishes its run-summary artifact with the
    error naming the key and the closest known field."""
    from eagle3.config import ConfigError

    state = eagle3_pipeline(
        preset="tiny",
        overrides=[f"run.workdir={tmp_path}", "run.name=bad-override", "train.learning_rate=1e-4"],
        until="vocab",
        return_state=True,
    )
    assert state.is_failed()
    with pytest.raises(ConfigError):
        state.result()
    (summary,) = _artifacts(state.state_details.flow_run_id, "bad-override-run-summary")
    assert "failed" in summary.description
    assert "train.learning_rate: unknown key; did you mean train.lr?" in summary.data
    assert "`train.learning_rate=1e-4`" in summary.data
    assert not (tmp_path / "bad-override").exists()  # nothing was started


def test_follow_explains_a_failed_run(failed_state, capsys):
    """follow() on a failed run prints the failed task, the exception and the last log lines, and the full log path."""
    from prefect.logging.handlers import APILogHandler

    from flows.follow import follow

    APILogHandler().flush()  # the run ran in this process: send its queued logs, as a finished worker subprocess has
    final = follow(failed_state.state_details.flow_run_id, poll_s=0.5, timeout_s=60, full_log="/somewhere/worker.log")
    assert final.state.is_failed()
    out = capsys.readouterr().out
    assert "failed task: merge-broken" in out
    assert "error: SourceError" in out and MISSING in out
    tail = out.split(" log lines:")[1].split("full log:")[0]
    assert 'File "' in tail and "SourceError" in tail  # the traceback's end, read from the API's logs
    assert "full log: /somewhere/worker.log" in out


def test_run_command_explains_a_failed_run_and_exits_non_zero(tmp_path, capsys):
    """`eagle3 run` (run_here) exits 1 on a failed run, prints why, and saves the run's full log where it says."""
    from flows.cli import run_here

    code = run_here(_failing_cfg(tmp_path, "broken-cli"), force=False, until="vocab", progress=False)
    assert code == 1
    out = capsys.readouterr().out
    assert "pipeline did not complete (Failed)" in out
    assert "failed task: merge-broken-cli" in out and "SourceError" in out and MISSING in out
    log_path = out.split("full log: ")[1].split()[0]
    assert log_path.startswith(str(tmp_path / "broken-cli" / "logs"))
    with open(log_path) as fh:
        assert MISSING in fh.read()


def test_follow_says_why_a_run_waits_and_marks_it_late_with_that_reason(capsys):
    """A run waiting on a work pool with no online worker: the follow view prints why, with the command that starts
    a worker, and once overdue the run is Late with that reason as its state's message."""
    from prefect.client.schemas.actions import WorkPoolCreate

    from flows.follow import follow

    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name="no-worker-test", type="process"), overwrite=True)
        flow_id = client.create_flow_from_name("no-worker-test-flow")
        deployment_id = client.create_deployment(
            flow_id=flow_id,
            name="waits",
            work_pool_name="no-worker-test",
            entrypoint="flows/pipeline.py:eagle3_pipeline",
        )
        run = client.create_flow_run_from_deployment(deployment_id)
    try:
        with pytest.raises(TimeoutError):
            follow(run.id, poll_s=0.2, timeout_s=3, waiting_after_s=0.0, late_after_s=0.0)
        out = capsys.readouterr().out
        assert "no worker polling work pool 'no-worker-test'" in out
        assert "eagle3 worker start --pool no-worker-test" in out
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(run.id).state
        assert state.name == "Late" and "no worker polling work pool 'no-worker-test'" in state.message
    finally:
        with get_client(sync_client=True) as client:
            client.delete_flow_run(run.id)
