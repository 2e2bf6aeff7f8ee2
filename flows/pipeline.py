"""The end-to-end pipeline flow: target check -> (synthesize) -> merge -> (regenerate) -> tokenize -> vocab
-> capture -> train -> export -> offline evaluation -> (SGLang benchmark when serve.enabled).

Parameters name a preset and dotted overrides (deployments never copy a preset's content), or
carry a full RunConfig. Every stage is skipped when its manifest matches its inputs, so a
re-run after a crash, a schedule or a UI "Retry" recomputes only what is missing or changed.

    eagle3 run --preset smollm2-demo --set data.sources.0.max_records=10000
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable
from datetime import datetime, timezone
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from eagle3 import deploy
from eagle3.config import ConfigError, RunConfig, intended_run_name, load_config
from eagle3.data.stages import regenerate
from eagle3.evaluate import stage as evaluate
from eagle3.features import stage as capture
from eagle3.run.history import AcceptanceRecord, acceptance_record, append_acceptance, read_acceptance, trend_rows
from eagle3.run.layout import run_layout
from eagle3.run.registry import UNTIL_CHOICES, StageSpec, stages_until
from eagle3.run.summary import StageRun, headline, render_early_failure, write_stage_runs
from eagle3.run.summary import render_summary as summary_markdown
from eagle3.train import stage as train
from flows.common import NeedsGpuError, PresetName, as_json, guard_crash_loop, preset_gpu_note
from flows.deploy import ALL_STEPS, STEP_STAGES
from flows.report import render_run_report
from flows.run_names import stage_run_name
from flows.stage_runs import StageClock
from tasks.artifacts import artifact_key, run_artifact_key
from tasks.data import DATA_TASKS, target_check_task
from tasks.stage_cache import UP_TO_DATE


def _call_stage(clock: StageClock, stage: str, task, cfg: RunConfig, *args: Any, force: bool = False) -> Any:
    """Run a stage task, recorded by ``clock`` (its cache key is the stage key while the stage is up to date:
    tasks.stage_cache; ``force`` skips Prefect's cache). A result served from Prefect's cache is reported as not
    computed (a record stored by an older version may hold the value of the run that did compute it)."""
    if force:
        task = task.with_options(refresh_cache=True)
    state = clock.call(stage, "task-run", lambda: task(cfg, *args, return_state=True))
    outcome = state.result()
    if outcome is None:
        return None
    return dataclasses.replace(outcome, computed=outcome.computed and state.name != UP_TO_DATE)


def run_data_stages(
    cfg: RunConfig, force: bool = False, results: dict[str, Any] | None = None, clock: StageClock | None = None
) -> dict[str, Any]:
    """Call the data-stage tasks in order; returns {stage: task result} (filled in place when ``results`` is given,
    so a caller that catches a failure knows which stages finished; ``clock`` records each stage's run)."""
    results = {} if results is None else results
    clock = clock or StageClock(cfg.run_dir)
    results["target"] = clock.call("target", "task-run", lambda: target_check_task(cfg, return_state=True)).result()
    for spec in _data_stages(cfg):
        if spec.module is regenerate and cfg.regenerate.num_slices > 1:
            from flows.regenerate import regenerate_in_slices

            results[spec.name] = clock.plain(
                spec.name, lambda: regenerate_in_slices(cfg, force), lambda outcome: outcome.computed
            )  # slice runs: no one run to link
        else:
            results[spec.name] = _call_stage(clock, spec.name, DATA_TASKS[spec.module], cfg, force, force=force)
    return results


def _data_stages(cfg: RunConfig) -> list[StageSpec]:
    """The registry's data stages that have something to do for ``cfg``, in order (no synthetic source: no
    synthesize; regeneration off: no regenerate)."""
    return [s for s in stages_until(LAST_STAGES[0]) if s.data and s.skip_reason(cfg) is None]


if TYPE_CHECKING:  # a Literal built at run time is no type to a type checker: it checks a str
    LastStage = str
else:
    LastStage = Literal[UNTIL_CHOICES]  # eagle3.run.registry: the UI's choices
LAST_STAGES: tuple[str, ...] = UNTIL_CHOICES


def run_capture(cfg: RunConfig, force: bool, results: dict[str, Any], clock: StageClock) -> None:
    """The capture subflow (one task per shard), or the reason it has nothing to do."""
    from flows.capture import eagle3_capture

    skipped = capture.skip_reason(cfg)
    if skipped:
        get_run_logger().info("%s: %s", capture.STAGE.name, skipped)
        clock.skipped(capture.STAGE.name, skipped)
        results[capture.STAGE.name] = {"skipped": skipped}
        return
    state = clock.call(capture.STAGE.name, "flow-run", lambda: eagle3_capture(config=cfg, return_state=True))
    results[capture.STAGE.name] = {**state.result(), "computed": state.name != UP_TO_DATE}


def run_train(cfg: RunConfig, force: bool, results: dict[str, Any], clock: StageClock) -> None:
    """Training: one torchrun task, or one task per node (train.nnodes > 1)."""
    from flows.train_nodes import train_nodes
    from tasks.train import train_task

    if cfg.train.nnodes > 1:
        results[train.STAGE.name] = clock.plain(
            train.STAGE.name, lambda: train_nodes(cfg), lambda summary: summary.computed
        )  # node runs: no one run to link
    else:
        results[train.STAGE.name] = _call_stage(clock, train.STAGE.name, train_task, cfg)


MODEL_RUNS: dict[ModuleType, Callable[[RunConfig, bool, dict[str, Any], StageClock], None]] = {
    capture: run_capture,
    train: run_train,
}
"""How the pipeline runs each stage between the data block and the deploy subflow (flows.deploy.STEP_STAGES)."""


def deploy_steps(until: str) -> list[str]:
    """The deploy subflow's steps that a run up to ``until`` reaches, in order."""
    reached = {s.name for s in stages_until(until)}
    return [step for step, stage in STEP_STAGES.items() if stage in reached]


def run_model_stages(
    cfg: RunConfig,
    until: str,
    force: bool = False,
    results: dict[str, Any] | None = None,
    clock: StageClock | None = None,
) -> dict[str, Any]:
    """The registry's stages after the data block as far as ``until``: capture (a subflow, one task per shard),
    training (torchrun), then the deploy subflow's steps (``results`` is filled in place when given; ``clock``
    records each stage's run)."""
    from flows.deploy import eagle3_deploy

    results = {} if results is None else results
    clock = clock or StageClock(cfg.run_dir)
    for spec in stages_until(until):
        if spec.module in MODEL_RUNS:
            MODEL_RUNS[spec.module](cfg, force, results, clock)
    steps = deploy_steps(until)
    if steps:
        subflow = eagle3_deploy.with_options(flow_run_name=stage_run_name(deploy.STAGE.name))  # "deploy-<run>"
        state = clock.call(
            deploy_label(steps), "flow-run", lambda: subflow(config=cfg, force=force, steps=steps, return_state=True)
        )
        deployed = state.result()
        if deployed.get("stage_runs"):  # the subflow's own row gives way to one row per step, linked to its run
            clock.replace_last([StageRun.from_json(r) for r in deployed["stage_runs"]])
        results.update({k: v for k, v in deployed.items() if k not in ("run_dir", "stage_runs")})
    return results


DEPLOY_ROW = "deploy subflow"
"""The run summary's row of the deploy subflow while it stands for its steps (when it failed)."""


def deploy_label(steps: list[str]) -> str:
    """The summary's name of the deploy subflow standing for ``steps``: 'deploy subflow (export, evaluate)'."""
    return f"{DEPLOY_ROW} ({', '.join(steps)})"


def planned_stages(cfg: RunConfig, until: str) -> list[str]:
    """The stages a run up to ``until`` calls, in order (the keys of its results)."""
    data = ["target"] + [s.name for s in _data_stages(cfg)]
    model = [s.name for s in stages_until(until) if s.module in MODEL_RUNS]
    return data + model + deploy_steps(until)


def failed_stage(cfg: RunConfig, until: str, results: dict[str, Any]) -> str:
    """The stage that was running when the flow raised: the first planned one without a result.

    The deploy subflow returns its steps together, so a failure inside it names the steps it had left.
    """
    pending = [s for s in planned_stages(cfg, until) if s not in results]
    if not pending:
        return "after the last stage"
    return pending[0] if pending[0] not in ALL_STEPS else deploy_label(pending)


def unstarted_stages(cfg: RunConfig, until: str, results: dict[str, Any], runs: list[StageRun]) -> list[str]:
    """The planned stages a failure left without a result or a row of their own (a failed deploy subflow's row
    stands for all its steps)."""
    recorded = {r.stage for r in runs}
    if any(r.stage.startswith(DEPLOY_ROW) for r in runs):
        recorded |= set(ALL_STEPS)
    return [s for s in planned_stages(cfg, until) if s not in results and s not in recorded]


@flow(name="eagle3-pipeline", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=4))  # type: ignore[arg-type]  # Prefect types task_runner invariantly in its future type
@preset_gpu_note
def eagle3_pipeline(
    preset: PresetName = "smollm2-demo",
    overrides: list[str] | None = None,
    config: RunConfig | None = None,
    force: bool = False,
    until: LastStage = LAST_STAGES[-1],
) -> dict[str, Any]:
    """Run the pipeline for a preset (+ dotted overrides) or a full config, up to stage ``until``.

    Args:
        preset: Preset in configs/ that describes the run (target model, data, sizes); `tiny` runs in seconds.
        overrides: Dotted `section.field=value` changes to the preset, one per item, e.g.
            `["data.sources.0.max_records=1000", "train.num_epochs=1"]`.
        config: A full run configuration; when given, `preset` and `overrides` are ignored.
        force: Recompute every stage even when its outputs on disk are up to date.
        until: Last stage to run (`vocab` = the data stages only; `deploy` = everything).
    """
    from eagle3.run.layout import write_run_config
    from infra.storage import run_lock

    cfg = start_or_explain(preset, list(overrides or []), config)
    get_run_logger().info("run directory %s", cfg.run_dir.resolve())
    results: dict[str, Any] = {}
    clock = StageClock(cfg.run_dir)
    try:
        with run_lock(cfg.run_dir, owner=f"prefect flow run {flow_run.id}"):
            write_run_config(cfg)
            run_data_stages(cfg, force, results, clock)
            run_model_stages(cfg, until, force, results, clock)
            record = record_acceptance(cfg, results)
    except Exception as exc:
        clock.not_started(unstarted_stages(cfg, until, results, clock.runs))
        failure = (failed_stage(cfg, until, results), f"{type(exc).__name__}: {exc}")
        create_markdown_artifact(
            markdown=render_summary(cfg, results, clock.runs, failure),
            key=artifact_key(cfg, "run-summary"),
            description="pipeline summary (failed)",
        )
        save_stage_runs(cfg, clock.runs)
        raise
    create_markdown_artifact(
        markdown=render_summary(cfg, results, clock.runs),
        key=artifact_key(cfg, "run-summary"),
        description="pipeline summary: per stage its state, seconds, outputs and run",
    )
    save_stage_runs(cfg, clock.runs)
    create_markdown_artifact(
        markdown=render_run_report(cfg),
        key=artifact_key(cfg, "run-report"),
        description="run report: data, capture, training curves, measured acceptance",
    )
    if record is not None:
        publish_acceptance_trend(cfg)
    return {"run_dir": str(cfg.run_dir.resolve()), **{k: as_json(v) for k, v in results.items() if k != "target"}}


def save_stage_runs(cfg: RunConfig, runs: list[StageRun]) -> None:
    """<run>/summary.json: the stage rows for the client that follows this run from another process (`eagle3 demo`
    prints each stage's seconds at the end). Best effort: a run dir that cannot be written must not hide the
    failure being reported."""
    with contextlib.suppress(OSError):
        write_stage_runs(run_layout(cfg).summary, str(flow_run.id), runs)


def start_or_explain(preset: str, overrides: list[str], config: RunConfig | None) -> RunConfig:
    """The run's config, after the checks every flow starts with (guard_crash_loop); a run refused before any stage
    (an invalid config, a preset that needs a GPU host on a host without CUDA, a crash loop) still gets its
    run-summary artifact saying why, then raises."""
    try:
        guard_crash_loop()
        return config or load_config(preset, overrides)
    except Exception as exc:
        name = config.run.name if config is not None else intended_run_name(preset, overrides)
        title, why, advice = early_failure_text(exc)
        create_markdown_artifact(
            markdown=render_early_failure(name, title, why, str(exc), preset, overrides, advice),
            key=run_artifact_key(name, "run-summary"),
            description=f"pipeline summary (failed: {title})",
        )
        raise


def early_failure_text(exc: Exception) -> tuple[str, str, str]:
    """(title, why, advice) of the run summary of a run refused before any stage by ``exc``."""
    if isinstance(exc, ConfigError):
        return (
            "invalid config",
            "the preset and overrides do not make a valid config.",
            "Fix the named keys (a `did you mean` names the closest known one) and run again; nothing was "
            "computed or changed on disk.",
        )
    if isinstance(exc, NeedsGpuError):
        return (
            "needs a GPU host",
            "the run's settings need a CUDA device and this host has none.",
            "Run it on a GPU worker (work pool `gpu` on a host with CUDA), pick a CPU preset (`tiny`, "
            "`smollm2-demo`) or override the settings named above; nothing was downloaded, computed or changed "
            "on disk.",
        )
    return (
        "refused before any stage",
        f"{type(exc).__name__}.",
        "The flow run's Logs tab holds the traceback; nothing was computed or changed on disk.",
    )


def record_acceptance(cfg: RunConfig, results: dict[str, Any]) -> AcceptanceRecord | None:
    """Append what this run's evaluation measured to the run's acceptance history (eagle3.run.history), when the
    run evaluated (computed or up to date); the record, or None. The history is bookkeeping beside the stages'
    outputs: a results.json it cannot read or a history it cannot write is logged as a warning, not a failed run."""
    layout = run_layout(cfg)
    if evaluate.STAGE.name not in results or not layout.eval_results.is_file():
        return None
    try:
        record = acceptance_record(
            json.loads(layout.eval_results.read_text()),
            str(flow_run.id),
            str(flow_run.name),
            datetime.now(timezone.utc),
            computed=bool(as_json(results[evaluate.STAGE.name]).get("computed")),
        )
        if record is not None:
            append_acceptance(layout.acceptance_history, record)
    except (OSError, ValueError) as exc:
        get_run_logger().warning(
            "acceptance history not updated (%s): %s: %s", layout.acceptance_history, type(exc).__name__, exc
        )
        return None
    return record


def publish_acceptance_trend(cfg: RunConfig) -> None:
    """Table artifact `<run>-acceptance-trend`: one row per pipeline run of this run name that evaluated."""
    from tasks.artifacts import MAX_TABLE_COLUMNS

    rows = trend_rows(read_acceptance(run_layout(cfg).acceptance_history), MAX_TABLE_COLUMNS)
    create_table_artifact(
        table=rows,
        key=artifact_key(cfg, "acceptance-trend"),
        description=f"acceptance length per run of `{cfg.run.name}` (newest last; eval/results.json "
        "of each, from history/acceptance.jsonl)",
    )


def render_summary(
    cfg: RunConfig, results: dict[str, Any], runs: list[StageRun], failure: tuple[str, str] | None = None
) -> str:
    """The run-summary markdown (eagle3.run.summary.render_summary), each stage's 'result' cell filled with its main
    counts (eagle3.run.summary.headline of its task's result)."""
    target = results.get("target")
    target_text = f"`{target.model_dir}` (fingerprint `{target.fingerprint}`)" if target is not None else ""
    rows = [
        r if r.note else dataclasses.replace(r, note=headline(r.stage, as_json(results.get(r.stage)))) for r in runs
    ]
    return summary_markdown(cfg.run.name, cfg.run_dir.resolve(), rows, target_text, failure)
