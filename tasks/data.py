"""Prefect tasks for the data stages: thin wrappers over the data stage modules (eagle3.run.registry).

Each task's cache key is the stage key (input manifests + config section + format version +
target fingerprint), never the task's source code, and only while the stage's manifest matches it on disk
(tasks.stage_cache): an up-to-date stage shows ``Cached``, any other runs.
Tasks take the RunConfig and return typed records (eagle3.run.stage.StageOutcome: paths and stats), never
tensors; the flows turn them into JSON where they return them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefect import task

from eagle3.config import RunConfig
from eagle3.data.stages import merge, regenerate, synthesize, tokenize, vocab
from eagle3.run.registry import get_stage
from eagle3.run.stage import StageOutcome
from tasks.artifacts import ProgressArtifact, artifact_key, publish_table
from tasks.retry import IO_RETRY
from tasks.stage_cache import STAGE_CACHE, computed_key, stage_cache_key

if TYPE_CHECKING:
    from eagle3.data.regenerate_slices import SliceStats


def _run(stage: str, cfg: RunConfig, force: bool) -> StageOutcome | None:
    """Run ``stage`` with the key the task's cache-key function computed (tasks.stage_cache: computed once)."""
    with ProgressArtifact(artifact_key(cfg, stage), f"{stage} ({cfg.run.name})") as progress:
        return get_stage(stage).run(cfg, progress=progress.callback, force=force, known_key=computed_key())


@dataclass(frozen=True)
class TargetCheck:
    """The prepared target: its folder, fingerprint and tokenizer report (eagle3.target.load.tokenizer_report)."""

    model_dir: str
    fingerprint: str
    report: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        """{"model_dir", "fingerprint", **report}."""
        return {"model_dir": self.model_dir, "fingerprint": self.fingerprint, **self.report}


@task(
    name=synthesize.STAGE.name,
    cache_key_fn=stage_cache_key(synthesize.STAGE.name),
    task_run_name="synthesize-{cfg.run.name}",
    tags=["inference"],
    **STAGE_CACHE,
    **IO_RETRY,
)
def synthesize_task(cfg: RunConfig, force: bool = False) -> StageOutcome | None:
    """Let the target write and answer the records of the synthetic sources (resumable by record)."""
    return _run(synthesize.STAGE.name, cfg, force)


@task(
    name=merge.STAGE.name,
    cache_key_fn=stage_cache_key(merge.STAGE.name),
    task_run_name="merge-{cfg.run.name}",
    **STAGE_CACHE,
    **IO_RETRY,
)
def merge_task(cfg: RunConfig, force: bool = False) -> StageOutcome:
    """Merge the chat sources into data/merged.parquet; publish data stats and rejects by reason."""
    result = _run(merge.STAGE.name, cfg, force)
    assert result is not None  # (only synthesize and regenerate may have nothing to do)
    publish_merge_tables(cfg, result.stats)
    return result


@task(
    name=regenerate.STAGE.name,
    cache_key_fn=stage_cache_key(regenerate.STAGE.name),
    task_run_name="regenerate-{cfg.run.name}",
    tags=["inference"],
    **STAGE_CACHE,
    **IO_RETRY,
)
def regenerate_task(cfg: RunConfig, force: bool = False) -> StageOutcome | None:
    """Re-answer user turns with the target (resumable by sample id)."""
    return _run(regenerate.STAGE.name, cfg, force)


@task(name="regenerate-slice", task_run_name="regenerate-{cfg.run.name}-slice{index}", tags=["inference"], **IO_RETRY)
def regenerate_slice_task(cfg: RunConfig, index: int) -> SliceStats:
    """Answer one slice of a sliced regeneration into its own journal (resumable by sample id)."""
    from eagle3.data.stages.regenerate import run_slice

    return run_slice(cfg, index)


@task(
    name=tokenize.STAGE.name,
    cache_key_fn=stage_cache_key(tokenize.STAGE.name),
    task_run_name="tokenize-{cfg.run.name}",
    **STAGE_CACHE,
    **IO_RETRY,
)
def tokenize_task(cfg: RunConfig, force: bool = False) -> StageOutcome:
    """Render with the chat template and compute loss masks into data/tokenized.parquet."""
    result = _run(tokenize.STAGE.name, cfg, force)
    assert result is not None  # (only synthesize and regenerate may have nothing to do)
    publish_table(cfg, "tokenize-stats", [_flat(result.stats)], "tokenization counts")
    return result


@task(
    name=vocab.STAGE.name,
    cache_key_fn=stage_cache_key(vocab.STAGE.name),
    task_run_name="vocab-{cfg.run.name}",
    **STAGE_CACHE,
    **IO_RETRY,
)
def vocab_task(cfg: RunConfig, force: bool = False) -> StageOutcome:
    """Build the draft vocab map; publish its coverage."""
    result = _run(vocab.STAGE.name, cfg, force)
    assert result is not None  # (only synthesize and regenerate may have nothing to do)
    publish_table(cfg, "vocab-coverage", [_flat(result.stats)], "draft vocab map")
    return result


DATA_TASKS = {
    synthesize: synthesize_task,
    merge: merge_task,
    regenerate: regenerate_task,
    tokenize: tokenize_task,
    vocab: vocab_task,
}
"""The task of each data stage module (the pipeline iterates the registry and calls these)."""


@task(name="target-check", task_run_name="target-check-{cfg.run.name}")
def target_check_task(cfg: RunConfig) -> TargetCheck:
    """Prepare the target and publish the tokenizer sanity report (fails on an end-of-turn mismatch)."""
    from eagle3.target.load import fingerprint, load_tokenizer, prepare_target, target_info, tokenizer_report

    model_dir = prepare_target(cfg)
    info = target_info(model_dir, cfg.target)
    report = tokenizer_report(load_tokenizer(model_dir), info)
    rows = [{"token": name, "text": v["token"], "id": v["id"]} for name, v in report["special_tokens"].items()]
    rows.append({"token": "end_of_turn", "text": report["end_of_turn_text"], "id": report["end_of_turn_ids"]})
    publish_table(cfg, "tokenizer-report", rows, f"special tokens; model stops on {report['stop_ids']}")
    return TargetCheck(str(model_dir), fingerprint(model_dir), report)


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
    publish_table(
        cfg,
        "rejects-by-reason",
        [{"reason": r, "count": n} for r, n in sorted(by_reason.items())],
        "rejected records by reason (data/rejects.jsonl)",
    )
