"""Prefect tasks for the data stages: thin wrappers over eagle3.run.stages.

Each task's cache key is the stage key (input manifests + config section + format version +
target fingerprint), never the task's source code. A cached result is only trusted while the
stage's manifest still matches on disk: the flow passes ``refresh_cache=True`` otherwise.
Tasks take the RunConfig and return small JSON dicts (paths and stats), never tensors.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.context import TaskRunContext

from eagle3.config import RunConfig
from tasks.artifacts import ProgressArtifact, artifact_key, publish_table
from tasks.retry import IO_RETRY

STAGE_CACHE = dict(persist_result=True, cache_result_in_memory=False)


def _stage_cache_key(stage: str):
    def key_fn(ctx: TaskRunContext, params: dict[str, Any]) -> str:
        from eagle3.run.stages import key_for

        return f"eagle3-{stage}-{key_for(params['cfg'], stage)}"

    return key_fn


def _run(stage: str, cfg: RunConfig, force: bool) -> dict[str, Any]:
    import eagle3.run.stages as stages

    with ProgressArtifact(artifact_key(cfg, stage), f"{stage} ({cfg.run.name})") as progress:
        outcome = getattr(stages, f"run_{stage}")(cfg, progress=progress.callback, force=force)
    return outcome.to_json() if outcome else {}


@task(name="synthesize", cache_key_fn=_stage_cache_key("synthesize"), task_run_name="synthesize-{cfg.run.name}",
      tags=["inference"], **STAGE_CACHE, **IO_RETRY)
def synthesize_task(cfg: RunConfig, force: bool = False) -> dict[str, Any]:
    """Let the target write and answer the records of the synthetic sources (resumable by record)."""
    return _run("synthesize", cfg, force)


@task(name="merge", cache_key_fn=_stage_cache_key("merge"), task_run_name="merge-{cfg.run.name}", **STAGE_CACHE,
      **IO_RETRY)
def merge_task(cfg: RunConfig, force: bool = False) -> dict[str, Any]:
    """Merge the chat sources into data/merged.parquet; publish data stats and rejects by reason."""
    result = _run("merge", cfg, force)
    publish_merge_tables(cfg, result["stats"])
    return result


@task(name="regenerate", cache_key_fn=_stage_cache_key("regenerate"), task_run_name="regenerate-{cfg.run.name}",
      tags=["inference"], **STAGE_CACHE, **IO_RETRY)
def regenerate_task(cfg: RunConfig, force: bool = False) -> dict[str, Any]:
    """Re-answer user turns with the target (resumable by sample id)."""
    return _run("regenerate", cfg, force)


@task(name="regenerate-slice", task_run_name="regenerate-{cfg.run.name}-slice{index}", tags=["inference"], **IO_RETRY)
def regenerate_slice_task(cfg: RunConfig, index: int) -> dict[str, Any]:
    """Answer one slice of a sliced regeneration into its own journal (resumable by sample id)."""
    from eagle3.run.stages import run_regenerate_slice

    return run_regenerate_slice(cfg, index)


@task(name="tokenize", cache_key_fn=_stage_cache_key("tokenize"), task_run_name="tokenize-{cfg.run.name}",
      **STAGE_CACHE, **IO_RETRY)
def tokenize_task(cfg: RunConfig, force: bool = False) -> dict[str, Any]:
    """Render with the chat template and compute loss masks into data/tokenized.parquet."""
    result = _run("tokenize", cfg, force)
    publish_table(cfg, "tokenize-stats", [_flat(result["stats"])], "tokenization counts")
    return result


@task(name="vocab", cache_key_fn=_stage_cache_key("vocab"), task_run_name="vocab-{cfg.run.name}",
      **STAGE_CACHE, **IO_RETRY)
def vocab_task(cfg: RunConfig, force: bool = False) -> dict[str, Any]:
    """Build the draft vocab map; publish its coverage."""
    result = _run("vocab", cfg, force)
    publish_table(cfg, "vocab-coverage", [_flat(result["stats"])], "draft vocab map")
    return result


@task(name="target-check", task_run_name="target-check-{cfg.run.name}")
def target_check_task(cfg: RunConfig) -> dict[str, Any]:
    """Prepare the target and publish the tokenizer sanity report (fails on an end-of-turn mismatch)."""
    from eagle3.target.load import fingerprint, load_tokenizer, prepare_target, target_info, tokenizer_report

    model_dir = prepare_target(cfg)
    info = target_info(model_dir, cfg.target)
    report = tokenizer_report(load_tokenizer(model_dir), info)
    rows = [{"token": name, "text": v["token"], "id": v["id"]} for name, v in report["special_tokens"].items()]
    rows.append({"token": "end_of_turn", "text": report["end_of_turn_text"], "id": report["end_of_turn_ids"]})
    publish_table(cfg, "tokenizer-report", rows, f"special tokens; model stops on {report['stop_ids']}")
    return {"model_dir": str(model_dir), "fingerprint": fingerprint(model_dir), **report}


def _flat(stats: dict[str, Any]) -> dict[str, Any]:
    """Scalars only (nested dicts are flattened with dotted keys) for table artifacts."""
    out: dict[str, Any] = {}
    for key, value in stats.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in _flat(value).items()})
        elif not isinstance(value, list):
            out[key] = value
    return out


def publish_merge_tables(cfg: RunConfig, stats: dict[str, Any]) -> None:
    """Per-source counts and rejects by reason as table artifacts."""
    rows = [{"source": name, **_flat(s)} for name, s in stats["sources"].items()]
    rows.append({"source": "(total)", **_flat(stats["total"])})
    publish_table(cfg, "data-stats", rows, "merged data: per-source counts (kept + rejected = read)")
    by_reason = stats["total"]["rejected_by_reason"]
    publish_table(cfg, "rejects-by-reason", [{"reason": r, "count": n} for r, n in sorted(by_reason.items())],
                  "rejected records by reason (data/rejects.jsonl)")
