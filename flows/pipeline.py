"""The end-to-end pipeline flow: target check -> (synthesize) -> merge -> (regenerate) -> tokenize -> vocab
-> capture -> train -> export -> offline evaluation -> (SGLang benchmark when serve.enabled).

Parameters name a preset and dotted overrides (deployments never copy a preset's content), or
carry a full RunConfig. Every stage is skipped when its manifest matches its inputs, so a
re-run after a crash, a schedule or a UI "Retry" recomputes only what is missing or changed.

    eagle3 run --preset smollm2-demo --set data.sources.0.max_records=10000
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from eagle3.config import ConfigError, RunConfig, intended_run_name, load_config
from eagle3.run.registry import ONLINE_SKIP, UNTIL_CHOICES
from eagle3.run.stages import synthetic_sources
from flows.common import PresetName, as_json, guard_crash_loop, preset_gpu_note
from flows.report import render_run_report
from flows.run_names import stage_run_name
from tasks.artifacts import artifact_key, run_artifact_key
from tasks.data import merge_task, regenerate_task, synthesize_task, target_check_task, tokenize_task, vocab_task
from tasks.stage_cache import UP_TO_DATE



def _call_stage(task, cfg: RunConfig, *args: Any, force: bool = False) -> Any:
    """Run a stage task (its cache key is the stage key while the stage is up to date: tasks.stage_cache; ``force``
    skips Prefect's cache). A result served from Prefect's cache is reported as not computed (a record stored by
    an older version may hold the value of the run that did compute it)."""
    if force:
        task = task.with_options(refresh_cache=True)
    state = task(cfg, *args, return_state=True)
    outcome = state.result()
    if outcome is None:
        return None
    return dataclasses.replace(outcome, computed=outcome.computed and state.name != UP_TO_DATE)


def run_data_stages(cfg: RunConfig, force: bool = False, results: dict[str, Any] | None = None) -> dict[str, Any]:
    """Call the data-stage tasks in order; returns {stage: task result} (filled in place when ``results`` is given,
    so a caller that catches a failure knows which stages finished)."""
    results = {} if results is None else results
    results["target"] = target_check_task(cfg)
    if synthetic_sources(cfg):
        results["synthesize"] = _call_stage(synthesize_task, cfg, force, force=force)
    results["merge"] = _call_stage(merge_task, cfg, force, force=force)
    if cfg.regenerate.enabled and cfg.regenerate.num_slices > 1:
        from flows.regenerate import regenerate_in_slices

        results["regenerate"] = regenerate_in_slices(cfg, force)
    elif cfg.regenerate.enabled:
        results["regenerate"] = _call_stage(regenerate_task, cfg, force, force=force)
    results["tokenize"] = _call_stage(tokenize_task, cfg, force, force=force)
    results["vocab"] = _call_stage(vocab_task, cfg, force, force=force)
    return results


LastStage = Literal[UNTIL_CHOICES]  # type: ignore[valid-type]  (eagle3.run.registry: the UI's choices)
LAST_STAGES: tuple[str, ...] = UNTIL_CHOICES
DEPLOY_STEPS = {"export": ["export"], "evaluate": ["export", "evaluate"], "deploy": ["export", "evaluate", "benchmark"]}


def run_model_stages(cfg: RunConfig, until: str, force: bool = False,
                     results: dict[str, Any] | None = None) -> dict[str, Any]:
    """Capture (a subflow, one task per shard), training (torchrun), then the deploy subflow, as far as ``until``
    (``results`` is filled in place when given)."""
    from flows.capture import eagle3_capture
    from flows.deploy import eagle3_deploy
    from flows.train_nodes import train_nodes
    from tasks.train import train_task

    reached = LAST_STAGES.index(until)
    results = {} if results is None else results
    if reached >= LAST_STAGES.index("capture"):
        if cfg.train.features == "online":
            get_run_logger().info("capture: %s", ONLINE_SKIP)
            results["capture"] = {"skipped": ONLINE_SKIP}
        else:
            state = eagle3_capture(config=cfg, return_state=True)
            results["capture"] = {**state.result(), "computed": state.name != UP_TO_DATE}
    if reached >= LAST_STAGES.index("train"):
        results["train"] = train_nodes(cfg) if cfg.train.nnodes > 1 else _call_stage(train_task, cfg)
    if until in DEPLOY_STEPS:
        deploy = eagle3_deploy.with_options(flow_run_name=stage_run_name("deploy"))  # "deploy-<run>"
        deployed = deploy(config=cfg, force=force, steps=DEPLOY_STEPS[until])
        results.update({k: v for k, v in deployed.items() if k != "run_dir"})
    return results


def planned_stages(cfg: RunConfig, until: str) -> list[str]:
    """The stages a run up to ``until`` calls, in order (the keys of its results)."""
    data = (["target"] + (["synthesize"] if synthetic_sources(cfg) else []) + ["merge"]
            + (["regenerate"] if cfg.regenerate.enabled else []) + ["tokenize", "vocab"])
    model = [s for s in ("capture", "train") if LAST_STAGES.index(until) >= LAST_STAGES.index(s)]
    return data + model + DEPLOY_STEPS.get(until, [])


def failed_stage(cfg: RunConfig, until: str, results: dict[str, Any]) -> str:
    """The stage that was running when the flow raised: the first planned one without a result.

    The deploy subflow returns its steps together, so a failure inside it names the steps it had left.
    """
    pending = [s for s in planned_stages(cfg, until) if s not in results]
    if not pending:
        return "after the last stage"
    return pending[0] if pending[0] not in DEPLOY_STEPS["deploy"] else "deploy subflow (" + ", ".join(pending) + ")"


@flow(name="eagle3-pipeline", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=4))
@preset_gpu_note
def eagle3_pipeline(preset: PresetName = "smollm2-demo", overrides: list[str] | None = None,
                    config: RunConfig | None = None, force: bool = False,
                    until: LastStage = "deploy") -> dict[str, Any]:
    """Run the pipeline for a preset (+ dotted overrides) or a full config, up to stage ``until``.

    Args:
        preset: Preset in configs/ that describes the run (target model, data, sizes); `tiny` runs in seconds.
        overrides: Dotted `section.field=value` changes to the preset, one per item, e.g.
            `["data.sources.0.max_records=1000", "train.num_epochs=1"]`.
        config: A full run configuration; when given, `preset` and `overrides` are ignored.
        force: Recompute every stage even when its outputs on disk are up to date.
        until: Last stage to run (`vocab` = the data stages only; `deploy` = everything).
    """
    from eagle3.run.stages import write_run_config
    from infra.storage import run_lock

    guard_crash_loop()
    try:
        cfg = config or load_config(preset, list(overrides or []))
    except ConfigError as exc:  # the run page still gets its summary, with the message (and any "did you mean")
        name = intended_run_name(preset, list(overrides or []))
        create_markdown_artifact(markdown=render_config_error(name, preset, list(overrides or []), str(exc)),
                                 key=run_artifact_key(name, "run-summary"),
                                 description="pipeline summary (failed: invalid config)")
        raise
    get_run_logger().info("run directory %s", cfg.run_dir.resolve())
    results: dict[str, Any] = {}
    try:
        with run_lock(cfg.run_dir, owner=f"prefect flow run {flow_run.id}"):
            write_run_config(cfg)
            run_data_stages(cfg, force, results)
            run_model_stages(cfg, until, force, results)
    except Exception as exc:
        failure = f"{type(exc).__name__}: {exc}"
        create_markdown_artifact(markdown=render_summary(cfg, results, (failed_stage(cfg, until, results), failure)),
                                 key=artifact_key(cfg, "run-summary"), description="pipeline summary (failed)")
        raise
    create_markdown_artifact(markdown=render_summary(cfg, results), key=artifact_key(cfg, "run-summary"),
                             description="pipeline summary")
    create_markdown_artifact(markdown=render_run_report(cfg), key=artifact_key(cfg, "run-report"),
                             description="run report: data, capture, training curves, measured acceptance")
    return {"run_dir": str(cfg.run_dir.resolve()), **{k: as_json(v) for k, v in results.items() if k != "target"}}


def render_config_error(run_name: str, preset: str, overrides: list[str], message: str) -> str:
    """Markdown run summary of a run that stopped before any stage because its config is invalid."""
    given = "\n".join(f"* `{o}`" for o in overrides) or "* (none)"
    return "\n".join([f"# Run `{run_name}` failed: invalid config", "",
                      "**Failed before any stage**: the preset and overrides do not make a valid config.", "",
                      "```", message[:4000], "```", "", f"preset: `{preset}`; overrides:", "", given, "",
                      "Fix the named keys (a `did you mean` names the closest known one) and run again; "
                      "nothing was computed or changed on disk."]) + "\n"


def render_summary(cfg: RunConfig, results: dict[str, Any], failure: tuple[str, str] | None = None) -> str:
    """Markdown: one line per stage with whether it ran and its main counts; first, for a failed run,
    ``failure`` = (stage, "ExceptionType: message")."""
    lines = [f"# Run `{cfg.run.name}`" + (" failed" if failure else ""), ""]
    if failure:
        lines += [f"**Failed at stage `{failure[0]}`**:", "", "```", failure[1][:4000], "```", "",
                  "The flow run's Logs tab holds the traceback; stages above it in the table completed.", ""]
    lines += [f"* run directory: `{cfg.run_dir.resolve()}`"]
    if "target" in results:
        lines.append(f"* target: `{results['target'].model_dir}` (fingerprint `{results['target'].fingerprint}`)")
    lines.append("")
    lines += ["| stage | computed | outputs |", "|---|---|---|"]
    results = {k: as_json(v) for k, v in results.items()}
    for stage in ("synthesize", "merge", "regenerate", "tokenize", "vocab"):
        res = results.get(stage)
        if res:
            outs = ", ".join(f"`{k}`" for k in res.get("outputs", {}))
            lines.append(f"| {stage} | {_computed(res)} | {outs} |")
    if results.get("capture", {}).get("skipped"):
        lines.append(f"| capture | no | {results['capture']['skipped']} |")
    elif "capture" in results:
        cap = results["capture"].get("stats", {})
        lines.append(f"| capture | {_computed(results['capture'])} | {cap.get('num_shards')} shards, "
                     f"{cap.get('num_tokens')} tokens, {cap.get('num_bytes', 0) / 1e6:.1f} MB |")
    if results.get("train"):
        last = results["train"].get("last_eval") or {}
        lines.append(f"| train | {_computed(results['train'])} | val acc_0 {last.get('acc_0')}, "
                     f"accept_len_est {last.get('accept_len_est')} |")
    if results.get("export"):
        lines.append(f"| export | {_computed(results['export'])} | "
                     f"{', '.join(f'`{k}`' for k in results['export'].get('outputs', {}))} |")
    if results.get("evaluate"):
        lines.append(f"| evaluate | {_computed(results['evaluate'])} | see the run report |")
    return "\n".join(lines) + "\n"


def _computed(res: dict[str, Any]) -> str:
    """The summary's 'computed' cell: yes, no (up to date: the task shows Cached), or unknown (multi-node train)."""
    return {True: "yes", False: "no (up to date)"}.get(res.get("computed"), "see its run")
