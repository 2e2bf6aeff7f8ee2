"""Prefect tasks of the deploy flow: export, offline evaluation, one benchmark per SGLang server, the report.

Each is a thin wrapper over the core, which runs the same without Prefect: ``eagle3.export.stage``,
``eagle3.evaluate.stage`` (an up-to-date manifest makes their task ``Cached``: tasks.stage_cache) and
``eagle3.deploy`` (the deploy stage: check the export, launch a server, probe its readiness, benchmark it, stop
it in ``finally``, compare and write the report). What is Prefect's stays here: task runs, progress and report
artifacts, the run logger. Server tasks are never cached (NO_CACHE: a live server is not a cacheable input) and are
tagged ``inference``. Tasks return the core's typed records (StageOutcome, ServingPlan, ServerRun, DeployReport);
the flow turns them into JSON where it returns them.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.config import RunConfig
from eagle3.deploy import ServingPlan
from eagle3.deploy_records import DeployReport, Role, ServerRun
from eagle3.evaluate import stage as evaluate
from eagle3.export import stage as export
from eagle3.run.stage import StageOutcome
from tasks.artifacts import ProgressArtifact, artifact_key, publish_table
from tasks.stage_cache import STAGE_CACHE, computed_key, stage_cache_key


@task(
    name=export.STAGE.name,
    task_run_name="export-{cfg.run.name}",
    cache_key_fn=stage_cache_key(export.STAGE.name),
    **STAGE_CACHE,
)
def export_task(cfg: RunConfig, force: bool = False) -> StageOutcome:
    """Export the trained drafter (up to date: ``Cached``, tasks.stage_cache)."""
    return export.run_export(cfg, force, computed_key())


@task(
    name=evaluate.STAGE.name,
    task_run_name="evaluate-{cfg.run.name}",
    tags=["gpu"],
    cache_key_fn=stage_cache_key(evaluate.STAGE.name),
    **STAGE_CACHE,
)
def evaluate_task(cfg: RunConfig, force: bool = False) -> StageOutcome:
    """Offline speculative decoding with the target in PyTorch: acceptance and lossless check (up to date:
    ``Cached``, tasks.stage_cache)."""
    with ProgressArtifact(artifact_key(cfg, evaluate.STAGE.name), f"offline evaluation ({cfg.run.name})") as progress:
        return evaluate.run_evaluate(cfg, progress=progress.callback, force=force, known_key=computed_key())


@task(name="serve-prepare", task_run_name="serve-prepare-{cfg.run.name}")
def prepare_serving_task(cfg: RunConfig) -> ServingPlan:
    """Check the exported drafter and resolve the target the servers load (model_path, draft_model_path)."""
    from eagle3.deploy import prepare_serving

    return prepare_serving(cfg)


@task(
    name="serve-benchmark", task_run_name="benchmark-{role}-{cfg.run.name}", tags=["inference"], cache_policy=NO_CACHE
)
def benchmark_server_task(cfg: RunConfig, role: Role, plan: ServingPlan, trio: str | None = None) -> ServerRun:
    """Launch one server (speculative: the EAGLE-3 setting ``trio``, or 'ngram'), wait for readiness, benchmark,
    always stop it."""
    from eagle3.deploy import benchmark_server

    name = role if trio is None else f"{role}-{trio}"
    with ProgressArtifact(artifact_key(cfg, f"benchmark-{name}"), f"benchmark {name} ({cfg.run.name})") as pa:
        return benchmark_server(cfg, role, plan, progress=pa.callback, logger=get_run_logger(), trio=trio)


@task(name="deploy-report", task_run_name="deploy-report-{cfg.run.name}")
def report_task(cfg: RunConfig, baseline: ServerRun, speculative: list[ServerRun]) -> DeployReport:
    """Compare the runs (MeasurementError if speedup > acceptance length), write results.json + report.md, publish."""
    from eagle3.deploy import finish_deploy

    report = finish_deploy(cfg, baseline, speculative)
    publish_table(
        cfg,
        "deploy-benchmark",
        [
            {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
            for row in report.to_json()["comparison"]
        ],
        "baseline vs each EAGLE-3 setting per concurrency level",
    )
    create_markdown_artifact(
        markdown=report.markdown, key=artifact_key(cfg, "deploy-report"), description="EAGLE-3 deploy benchmark"
    )
    return report
