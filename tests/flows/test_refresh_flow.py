"""The refresh flow: a thin wrapper over eagle3.refresh.core whose report becomes the run's refresh-report artifact."""

from __future__ import annotations

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from eagle3.config import load_config
from flows.refresh import eagle3_refresh


def test_a_refresh_without_new_prompts_promotes_the_export_and_reports_why_it_stopped(tmp_path):
    """On a finished tiny run with an empty prompt file the flow completes: the run's export becomes the current
    drafter, and the artifact `<run>-refresh-report` says there was no new prompt."""
    from eagle3.export.stage import run_export
    from eagle3.features.capture import run_capture
    from eagle3.run.stages import run_all
    from eagle3.train.loop import train

    (tmp_path / "new.jsonl").write_text("")
    overrides = [
        f"run.workdir={tmp_path}",
        "run.name=rf",
        "train.max_steps=1",
        "train.eval_every_steps=0",
        f"refresh.prompts={tmp_path / 'new.jsonl'}",
    ]
    cfg = load_config("tiny", overrides)
    run_all(cfg)
    run_capture(cfg)
    assert train(cfg).status == "done"
    run_export(cfg)
    result = eagle3_refresh(preset="tiny", overrides=overrides)
    assert result["status"] == "no new prompts" and result["current"].startswith("run-")
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["rf-refresh-report"])))
    assert found and "no new prompts" in str(found[0].data)
