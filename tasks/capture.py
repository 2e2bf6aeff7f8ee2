"""Prefect tasks for hidden-state capture: prepare (spec, plan, disk preflight), one task per shard, finalize.

Shard tasks are tagged `inference` (a global concurrency limit caps them across runs), retried
with backoff on transient errors, and skip themselves when their manifest is already on disk:
completion lives in `features/shard-NNNNN.done.json`, not in Prefect's database, so a re-run on
another machine with the same run directory captures only what is missing.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from eagle3.config import RunConfig
from tasks.artifacts import publish_table
from tasks.retry import IO_RETRY


@task(name="capture-prepare", task_run_name="capture-prepare-{cfg.run.name}")
def prepare_capture_task(cfg: RunConfig) -> dict[str, Any]:
    """Write spec.json and plan.json, check the disk; returns the plan summary and pending shards."""
    from eagle3.features.capture import prepare_capture

    plan = prepare_capture(cfg)
    summary = plan.summary()
    publish_table(cfg, "capture-plan", [{k: v for k, v in summary.items() if not isinstance(v, list)}],
                  "capture plan: shards, tokens and bytes")
    return summary


@task(name="capture-shard", task_run_name="capture-{cfg.run.name}-shard-{shard_index:05d}", tags=["inference"],
      **IO_RETRY)
def capture_shard_task(cfg: RunConfig, shard_index: int) -> dict[str, Any]:
    """Capture one shard (no-op when its manifest already matches)."""
    from eagle3.features.capture import capture_shard

    return capture_shard(cfg, shard_index)


@task(name="capture-finalize", task_run_name="capture-finalize-{cfg.run.name}")
def finalize_capture_task(cfg: RunConfig) -> dict[str, Any]:
    """Check every shard is complete and write the capture manifest."""
    from eagle3.features.capture import finalize_capture

    return finalize_capture(cfg)
