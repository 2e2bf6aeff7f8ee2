"""The refresh flow: one refresh of a run (eagle3.refresh.core, which runs without Prefect too), its report as the
run's `<run>-refresh-report` artifact.

Deployment `eagle3-refresh` (prefect.yaml) runs it on a schedule that is off until turned on in the UI; its
overrides name the prompt source, e.g. `["refresh.prompts=/data/traffic/"]`. A run that finds no new prompt, or
whose candidate the gate keeps, completes; the report says which and why. docs/refresh.md.

    python -m eagle3.refresh --preset smollm2-demo --set refresh.prompts=/data/traffic/    # the same, no Prefect
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from eagle3.config import RunConfig, load_config
from flows.common import PresetName, guard_crash_loop, preset_gpu_note
from tasks.artifacts import artifact_key


@flow(name="eagle3-refresh", log_prints=True)
@preset_gpu_note
def eagle3_refresh(
    preset: PresetName = "smollm2-demo", overrides: list[str] | None = None, config: RunConfig | None = None
) -> dict[str, Any]:
    """Fold the prompts past the watermark into the run's data, train a candidate from the promoted drafter, and
    promote it only if the gate measures it better.

    Args:
        preset: Preset in configs/ that describes the run (target model, data, sizes); `tiny` runs in seconds.
        overrides: Dotted `section.field=value` changes to the preset, one per item; name the prompt source, e.g.
            `["refresh.prompts=/data/traffic/", "refresh.max_steps=500"]`.
        config: A full run configuration; when given, `preset` and `overrides` are ignored.
    """
    from eagle3.refresh.core import run_refresh
    from eagle3.refresh.report import refresh_markdown

    guard_crash_loop()
    cfg = config or load_config(preset, list(overrides or []))
    outcome = run_refresh(cfg, owner=f"prefect flow run {flow_run.id}")
    create_markdown_artifact(
        markdown=refresh_markdown(outcome),
        key=artifact_key(cfg, "refresh-report"),
        description=f"refresh: {outcome.status} ({outcome.reason})"[:500],
    )
    return outcome.to_json()
