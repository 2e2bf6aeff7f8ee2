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

from typing import Any, Literal, get_args

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from eagle3.config import RunConfig, load_config
from eagle3.deploy import NOT_ENABLED, DeployReport
from flows.common import PresetName, as_json, guard_crash_loop, preset_gpu_note
from flows.stage_runs import StageClock, ui_url
from tasks.deploy import benchmark_server_task, evaluate_task, export_task, prepare_serving_task, report_task

DeployStep = Literal["export", "evaluate", "benchmark"]
ALL_STEPS: tuple[str, ...] = get_args(DeployStep)


def run_benchmarks(cfg: RunConfig) -> DeployReport:
    """Baseline server, then one server per EAGLE-3 setting (each started, benchmarked, stopped), then the report."""
    from eagle3.deploy import trios

    plan = prepare_serving_task(cfg)
    baseline = benchmark_server_task(cfg, "baseline", plan)
    speculative = [benchmark_server_task(cfg, "speculative", plan, trio) for trio in trios(cfg)]
    return report_task(cfg, baseline, speculative)


def run_deploy_steps(cfg: RunConfig, steps: list[str], force: bool = False,
                     clock: StageClock | None = None) -> dict[str, Any]:
    """The chosen steps in order; {step: task result} (typed records; a skipped benchmark says why). ``clock``
    records each step's run (export and evaluate: their task runs; the benchmark's tasks: this flow run)."""
    unknown = sorted(set(steps) - set(ALL_STEPS))
    if unknown:
        raise ValueError(f"unknown deploy steps {unknown}; choose from {list(ALL_STEPS)}")
    clock = clock or StageClock(cfg.run_dir)
    results: dict[str, Any] = {}
    if "export" in steps:
        results["export"] = clock.call("export", "task-run",
                                       lambda: export_task(cfg, force, return_state=True)).result()
    if "evaluate" in steps:
        results["evaluate"] = clock.call("evaluate", "task-run",
                                         lambda: evaluate_task(cfg, force, return_state=True)).result()
    if "benchmark" in steps:
        if cfg.serve.enabled:
            results["benchmark"] = clock.plain("benchmark", lambda: run_benchmarks(cfg), lambda _: True,
                                               url=ui_url("flow-run", flow_run.id))
        else:
            get_run_logger().warning(NOT_ENABLED)
            clock.skipped("benchmark", NOT_ENABLED)
            results["benchmark"] = {"skipped": NOT_ENABLED}
    return results


@flow(name="eagle3-deploy", log_prints=True)
@preset_gpu_note
def eagle3_deploy(preset: PresetName = "smollm2-demo", overrides: list[str] | None = None,
                  config: RunConfig | None = None, force: bool = False,
                  steps: list[DeployStep] | None = None) -> dict[str, Any]:
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
    clock = StageClock(cfg.run_dir)
    with run_lock(cfg.run_dir, owner="prefect flow eagle3-deploy"):
        results = run_deploy_steps(cfg, list(steps or ALL_STEPS), force, clock)
    return {"run_dir": str(cfg.run_dir.resolve()), **{step: as_json(result) for step, result in results.items()},
            "stage_runs": clock.to_json()}  # per step: state, seconds, outputs, link (the pipeline's run summary)
