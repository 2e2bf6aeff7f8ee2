"""An identical re-run of the pipeline (tiny preset, up to evaluate): every stage shows as skipped the same way.

The first run computes every stage; the second finds every manifest matching its key. Every stage task of the
second run (data stages, capture's finalize, train, export, evaluate) and the capture subflow end in Prefect's
``Cached`` state, no torchrun starts, no train progress is published again, and the run summary says each stage was
up to date, in one table with each stage's seconds, outputs and a link to its task or subflow run. Both runs
evaluated, so the acceptance trend of the run name has a row for each. The subflow runs are named after their stage
and the run (``capture-<run>``, ``deploy-<run>``), and so is a run of the train flow (``train-<run>``).
"""

from __future__ import annotations

import json

import pytest

from eagle3.config import load_config
from flows.follow import RunView, flow_run_tree
from flows.pipeline import eagle3_pipeline
from tasks.stage_cache import UP_TO_DATE

STAGE_TASKS = ("merge", "tokenize", "vocab", "capture-finalize", "train", "export", "evaluate")


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("up-to-date")
    config = load_config(
        "tiny",
        [
            f"run.workdir={workdir}",
            "train.max_steps=4",
            "train.eval_every_steps=2",
            "evaluate.num_prompts=1",
            "evaluate.max_new_tokens=8",
        ],
    )
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
    _check_summary_table(text, flows)
    _check_acceptance_trend(cfg, artifacts, flows[0], runs=2)


SUMMARY_STAGES = ("target", "merge", "tokenize", "vocab", "capture", "train", "export", "evaluate")
OUTPUTS = {
    "merge": "data/merged.parquet",
    "tokenize": "data/tokenized.parquet",
    "vocab": "vocab/",
    "capture": "features/",
    "train": "train/",
    "export": "export/",
    "evaluate": "eval/",
}


def _check_summary_table(text: str, flows) -> None:
    """One row per stage, in order: target Completed, every other stage Cached (up to date); each with its seconds,
    its outputs under the run dir and a link to its task run (capture: to the capture subflow's page)."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(head, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines[1:]]
    assert [r["stage"] for r in rows] == list(SUMMARY_STAGES), text
    assert {r["stage"]: r["state"] for r in rows} == {"target": "Completed"} | dict.fromkeys(
        SUMMARY_STAGES[1:], "Cached (up to date)"
    )
    assert all(float(r["seconds"]) >= 0 for r in rows), text
    assert {r["stage"]: r["outputs"].strip("`") for r in rows if r["outputs"]} == OUTPUTS
    capture_run = next(f for f in flows if f.name.startswith("capture-"))
    for r in rows:
        kind = "flow-run" if r["stage"] == "capture" else "task-run"
        assert f"/runs/{kind}/" in r["run"], r
    assert f"/runs/flow-run/{capture_run.id})" in next(r["run"] for r in rows if r["stage"] == "capture")


def _check_acceptance_trend(cfg, artifacts, pipeline_run, runs: int) -> None:
    """The trend artifact of this run holds one row per pipeline run of the run name that evaluated (the first
    measured, the identical re-runs reuse its figures: eval/results.json's, n-gram baseline included), read from
    <run>/history/acceptance.jsonl, whose last line is this run's."""
    from datetime import datetime

    from eagle3.run.history import acceptance_record

    (trend,) = [a for a in artifacts if a.key == f"{cfg.run.name}-acceptance-trend"]
    rows = json.loads(trend.data) if isinstance(trend.data, str) else trend.data
    assert len(rows) == runs, rows
    assert [r["evaluation"] for r in rows] == ["measured"] + ["up to date (earlier figures)"] * (runs - 1)
    assert rows[-1]["flow run"] == pipeline_run.name
    measured = acceptance_record(
        json.loads((cfg.run_dir / "eval" / "results.json").read_text()), "", "", datetime.now(), True
    )
    assert "ngram" in measured.accept_len and any(m.startswith("chain-") for m in measured.accept_len)
    for method, accept in measured.accept_len.items():
        assert all(r[method] == f"{accept:.3f}" for r in rows), (method, rows)
    history = (cfg.run_dir / "history" / "acceptance.jsonl").read_text().splitlines()
    assert len(history) == runs and json.loads(history[-1])["id"] == str(pipeline_run.id)


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
