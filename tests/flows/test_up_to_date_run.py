"""An identical re-run of the pipeline (tiny preset, up to evaluate): every stage shows as skipped the same way.

The first run computes every stage; the second finds every manifest matching its key. Every stage task of the
second run (data stages, capture's finalize, train, export, evaluate) and the capture subflow end in Prefect's
``Cached`` state, no torchrun starts, no train progress is published again, and the run summary says each stage was
up to date. The subflow runs are named after their stage and the run (``capture-<run>``, ``deploy-<run>``), and so
is a run of the train flow (``train-<run>``).
"""

from __future__ import annotations

import pytest

from eagle3.config import load_config
from flows.follow import RunView, flow_run_tree
from flows.pipeline import eagle3_pipeline
from tasks.stage_cache import UP_TO_DATE

STAGE_TASKS = ("merge", "tokenize", "vocab", "capture-finalize", "train", "export", "evaluate")


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("up-to-date")
    config = load_config("tiny", [f"run.workdir={workdir}", "train.max_steps=4", "train.eval_every_steps=2",
                                  "evaluate.num_prompts=1", "evaluate.max_new_tokens=8"])
    first = eagle3_pipeline(config=config, until="evaluate", return_state=True)
    assert first.is_completed(), first.message
    return config


def _runs_of(pipeline_state):
    """(flow runs of the pipeline run and its subflows, their task runs)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )

    with get_client(sync_client=True) as client:
        flows = flow_run_tree(client, RunView(root=pipeline_state.state_details.flow_run_id))
        ids = [f.id for f in flows]
        tasks = client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=ids)))
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=ids)))
    return flows, tasks, artifacts


def test_identical_rerun_shows_every_stage_cached_and_starts_no_trainer(cfg, monkeypatch):
    """Second identical run: every stage task (and the capture subflow) is Cached, torchrun is never launched,
    no train progress artifact is written, and the summary calls every stage up to date."""
    import infra.torchrun

    launched = []
    monkeypatch.setattr(infra.torchrun, "run_torchrun", lambda *a, **k: launched.append(a))
    log = cfg.run_dir / "train" / "torchrun.log"
    log_before = log.stat().st_mtime_ns if log.exists() else None

    state = eagle3_pipeline(config=cfg, until="evaluate", return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    flows, tasks, artifacts = _runs_of(state)

    by_task = {t.name.removesuffix(f"-{cfg.run.name}"): t.state.name for t in tasks}
    stage_states = {t: by_task.get(t) for t in STAGE_TASKS}
    assert stage_states == dict.fromkeys(STAGE_TASKS, UP_TO_DATE), by_task
    assert "capture-prepare" not in by_task  # an up-to-date capture plans nothing
    capture = [f for f in flows if f.flow_id != flows[0].flow_id and f.state.name == UP_TO_DATE]
    assert capture, [(f.name, f.state.name) for f in flows]
    assert launched == [] and (log.stat().st_mtime_ns if log.exists() else None) == log_before
    assert not [a for a in artifacts if a.key and a.key.endswith("train-progress")]

    for stage in ("merge", "tokenize", "vocab", "capture", "train", "export", "evaluate"):
        assert result[stage]["computed"] is False, stage
    summary = [a for a in artifacts if a.key == f"{cfg.run.name}-run-summary"]
    assert len(summary) == 1
    text = summary[0].data
    assert "see capture flow" not in text and "see train task" not in text
    for stage in ("capture", "train", "export", "evaluate"):
        assert f"| {stage} | no (up to date) |" in text, text


def test_subflow_runs_are_named_after_their_stage_and_run(cfg):
    """A pipeline run's subflow runs are 'capture-<run>' and 'deploy-<run>', not two random words; a train flow
    run is 'train-<run>', also when the run is named by preset and overrides only."""
    from prefect.client.orchestration import get_client

    from flows.capture import eagle3_capture
    from flows.run_names import run_name_of
    from flows.train import eagle3_train

    state = eagle3_pipeline(config=cfg, until="evaluate", return_state=True)
    flows, _, _ = _runs_of(state)
    assert sorted(f.name for f in flows[1:]) == [f"capture-{cfg.run.name}", f"deploy-{cfg.run.name}"]
    train = eagle3_train(config=cfg, return_state=True)
    by_preset = eagle3_capture(preset="tiny", overrides=[f"run.workdir={cfg.run.workdir}"], return_state=True)
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(train.state_details.flow_run_id).name == f"train-{cfg.run.name}"
        assert client.read_flow_run(by_preset.state_details.flow_run_id).name == f"capture-{cfg.run.name}"
    assert run_name_of({"config": {"run": {"name": "x"}}}) == "x"
    assert run_name_of({"preset": "tiny", "overrides": ["run.name=y"]}) == "y"
