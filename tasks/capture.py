"""Prefect tasks for hidden-state capture: prepare (spec, plan, disk preflight), one task per shard, finalize.

Shard tasks are tagged `inference` (a global concurrency limit caps them across runs), retried
with backoff on transient errors, and skip themselves when their manifest is already on disk:
completion lives in `features/shard-NNNNN.done.json`, not in Prefect's database, so a re-run on
another machine with the same run directory captures only what is missing.
Tasks return the core's typed records (CaptureSummary, ShardResult, StageOutcome); the flow turns them into JSON.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect import task

from eagle3.config import RunConfig
from eagle3.features import stage as capture
from eagle3.run.stage import StageOutcome
from tasks.artifacts import publish_table
from tasks.retry import IO_RETRY
from tasks.stage_cache import STAGE_CACHE, computed_key, stage_cache_key

if TYPE_CHECKING:  # the core imports torch; the tasks import it only when they run
    from eagle3.features.capture import ShardResult
    from eagle3.features.plan import CaptureSummary


@task(name="capture-prepare", task_run_name="capture-prepare-{cfg.run.name}")
def prepare_capture_task(cfg: RunConfig) -> CaptureSummary:
    """Write spec.json and plan.json, check the disk; returns the plan summary and pending shards."""
    from eagle3.features.capture import prepare_capture

    summary = prepare_capture(cfg).summary()
    publish_table(
        cfg,
        "capture-plan",
        [{k: v for k, v in summary.to_json().items() if not isinstance(v, list)}],
        "capture plan: shards, tokens and bytes",
    )
    return summary


@task(
    name="capture-shard", task_run_name="capture-{cfg.run.name}-shard-{shard_index:05d}", tags=["inference"], **IO_RETRY
)
def capture_shard_task(cfg: RunConfig, shard_index: int) -> ShardResult:
    """Capture one shard (no-op when its manifest already matches)."""
    from eagle3.features.capture import capture_shard

    return capture_shard(cfg, shard_index)


@task(
    name="capture-finalize",
    task_run_name="capture-finalize-{cfg.run.name}",
    cache_key_fn=stage_cache_key(capture.STAGE.name),
    **STAGE_CACHE,
)
def finalize_capture_task(cfg: RunConfig, known_key: str | None = None) -> StageOutcome:
    """Check every shard is complete and write the capture manifest; the capture stage's outcome (a capture that is
    up to date: ``Cached``, with the manifest on disk, tasks.stage_cache). ``known_key``: the stage key the capture
    flow computed (the cache-key function takes it instead of computing it again)."""
    from eagle3.features.capture import finalize_outcome

    return finalize_outcome(cfg, known_key=computed_key() or known_key)
