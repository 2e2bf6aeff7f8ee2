"""The deploy flow: export -> offline evaluation -> baseline and EAGLE-3 SGLang benchmarks -> report.

Usable alone (deployment `eagle3-deploy`) and as a subflow. ``steps`` picks the parts to run, so a
caller that exported and evaluated already can ask for the benchmark only. The benchmark runs only
with ``serve.enabled`` (a GPU host with SGLang); it starts the baseline server, benchmarks it and
stops it, then does the same with the speculative server (never both at once: they would share the
GPUs), compares them and writes ``<run>/deploy/results.json`` and ``report.md``.

    prefect deployment run 'eagle3-deploy/eagle3-deploy' --param preset=llama31-8b \
        --param overrides='["serve.enabled=true"]'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from eagle3 import deploy
from eagle3.config import RunConfig, load_config
from eagle3.deploy import NOT_ENABLED
from eagle3.deploy_records import DeployReport
from eagle3.evaluate import stage as evaluate
from eagle3.export import stage as export
from flows.common import PresetName, as_json, guard_crash_loop, preset_gpu_note
from flows.stage_runs import StageClock, ui_url
from tasks.deploy import benchmark_server_task, evaluate_task, export_task, prepare_serving_task, report_task

BENCHMARK = "benchmark"
"""The deploy stage's step: the name ``steps`` takes for it (deployments, docs/deploy.md and users' scripts pass it,
so it stays as it was before the stage was named deploy), the key of its result and its row in the run summary."""
STEP_STAGES: dict[str, str] = {
    export.STAGE.name: export.STAGE.name,
    evaluate.STAGE.name: evaluate.STAGE.name,
    BENCHMARK: deploy.STAGE.name,
}
"""The steps in the order they run, and the registry stage each runs (eagle3.run.registry)."""
ALL_STEPS: tuple[str, ...] = tuple(STEP_STAGES)
if TYPE_CHECKING:  # a Literal built at run time is no type to a type checker: it checks a str
    DeployStep = str
else:
    DeployStep = Literal[ALL_STEPS]  # the UI's choices


def run_benchmarks(cfg: RunConfig) -> DeployReport:
    """Baseline server, then one server per EAGLE-3 setting and (serve.ngram) SGLang's n-gram server (each started,
    benchmarked, stopped), then the report."""
    from eagle3.deploy import speculative_settings

    plan = prepare_serving_task(cfg)
    baseline = benchmark_server_task(cfg, "baseline", plan)
    speculative = [benchmark_server_task(cfg, "speculative", plan, trio) for trio in speculative_settings(cfg)]
    return report_task(cfg, baseline, speculative)


def _export(cfg: RunConfig, force: bool, clock: StageClock) -> Any:
    return clock.call(export.STAGE.name, "task-run", lambda: export_task(cfg, force, return_state=True)).result()


def _evaluate(cfg: RunConfig, force: bool, clock: StageClock) -> Any:
    return clock.call(evaluate.STAGE.name, "task-run", lambda: evaluate_task(cfg, force, return_state=True)).result()


def _benchmark(cfg: RunConfig, force: bool, clock: StageClock) -> Any:
    if not cfg.serve.enabled:
        get_run_logger().warning(NOT_ENABLED)
        clock.skipped(BENCHMARK, NOT_ENABLED)
        return {"skipped": NOT_ENABLED}
    return clock.plain(BENCHMARK, lambda: run_benchmarks(cfg), lambda _: True, url=ui_url("flow-run", flow_run.id))


STEP_RUNS: dict[str, Callable[[RunConfig, bool, StageClock], Any]] = {
    export.STAGE.name: _export,
    evaluate.STAGE.name: _evaluate,
    BENCHMARK: _benchmark,
}
"""How each step runs: export and evaluate as their task runs, the benchmark's tasks in this flow run."""


def run_deploy_steps(
    cfg: RunConfig, steps: list[str], force: bool = False, clock: StageClock | None = None
) -> dict[str, Any]:
    """The chosen steps in order; {step: task result} (typed records; a skipped benchmark says why). ``clock``
    records each step's run (export and evaluate: their task runs; the benchmark's tasks: this flow run)."""
    unknown = sorted(set(steps) - set(ALL_STEPS))
    if unknown:
        raise ValueError(f"unknown deploy steps {unknown}; choose from {list(ALL_STEPS)}")
    clock = clock or StageClock(cfg.run_dir, STEP_STAGES)
    return {step: STEP_RUNS[step](cfg, force, clock) for step in ALL_STEPS if step in steps}


@flow(name="eagle3-deploy", log_prints=True)
@preset_gpu_note
def eagle3_deploy(
    preset: PresetName = "smollm2-demo",
    overrides: list[str] | None = None,
    config: RunConfig | None = None,
    force: bool = False,
    steps: list[DeployStep] | None = None,
) -> dict[str, Any]:
    """Export, evaluate offline and (serve.enabled) benchmark baseline vs EAGLE-3 SGLang servers.

    Args:
        preset: Preset in configs/ that describes the run (target model, data, sizes); `tiny` runs in seconds.
        overrides: Dotted `section.field=value` changes to the preset, one per item, e.g.
            `["data.sources.0.max_records=1000", "train.num_epochs=1"]`.
        config: A full run configuration; when given, `preset` and `overrides` are ignored.
        force: Export and evaluate again even when their outputs on disk are up to date.
        steps: Parts to run, in order: `export`, `evaluate`, `benchmark` (the benchmark needs `serve.enabled`);
            empty = all three.
    """
    from infra.storage import run_lock

    guard_crash_loop()
    cfg = config or load_config(preset, list(overrides or []))
    clock = StageClock(cfg.run_dir, STEP_STAGES)
    with run_lock(cfg.run_dir, owner="prefect flow eagle3-deploy"):
        results = run_deploy_steps(cfg, list(steps or ALL_STEPS), force, clock)
    return {
        "run_dir": str(cfg.run_dir.resolve()),
        **{step: as_json(result) for step, result in results.items()},
        "stage_runs": clock.to_json(),
    }  # per step: state, seconds, outputs, link (the pipeline's run summary)
