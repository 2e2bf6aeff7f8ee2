"""The capture flow: hidden states of every tokenized sample, in resumable, validated shards.

Usable alone (deployment `eagle3-capture`, or `eagle3 capture --preset tiny`) and as a subflow of
the pipeline. Shards already on disk are skipped; the live progress artifact shows shards done,
tokens/s, ETA and GB written.

With capture.num_slices = N above 1 the flow fans out: it splits the pending shards into N disjoint slices of
about equal tokens and submits each as a run of the `eagle3-capture-slice` deployment on the gpu pool, so N
workers (one per host, each with its own model or managed SGLang servers) capture at once into the shared run
directory. The parent counts done files on disk for one progress artifact over all slices, submits a slice
again when its run ends Crashed or Failed (flows.common.run_slices: MAX_SLICE_ROUNDS submissions in all; the
shards it finished are skipped), and finalizes only when every shard is complete. Slice runs take no run lock:
the parent holds it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.futures import PrefectFuture, as_completed
from prefect.states import Completed
from prefect.task_runners import ThreadPoolTaskRunner

from eagle3.config import RunConfig, load_config
from eagle3.features import stage as capture
from eagle3.run.layout import run_layout
from eagle3.run.progress import eta_text
from eagle3.run.stage import StageOutcome, read_manifest
from flows.common import PresetName, guard_crash_loop, preset_gpu_note, run_slices
from flows.run_names import stage_run_name
from tasks.artifacts import artifact_key, publish_table
from tasks.capture import capture_shard_task, finalize_capture_task, prepare_capture_task
from tasks.stage_cache import UP_TO_DATE, key_and_state

MAX_THREADS = 64
SLICE_DEPLOYMENT = "eagle3-capture-slice/eagle3-capture-slice"

if TYPE_CHECKING:  # the capture core imports torch; the flow imports it only when it runs
    from eagle3.features.capture import ShardResult
    from eagle3.features.plan import CaptureSummary


class CaptureProgress:
    """Shards done, tokens/s, ETA and bytes written, as one live progress artifact."""

    def __init__(self, cfg: RunConfig, summary: CaptureSummary):
        self.num_shards = summary.num_shards
        self.num_done = self.num_shards - len(summary.pending)
        self.tokens_left = summary.num_tokens_pending
        self.num_tokens = self.num_bytes = 0
        self.t0 = time.monotonic()
        # Called from sync code, Prefect's async_dispatch returns the id itself (its type also names a coroutine).
        self.artifact_id = cast(
            UUID,
            create_progress_artifact(
                progress=self._percent(), key=artifact_key(cfg, "capture-progress"), description=self._text()
            ),
        )

    def _percent(self) -> float:
        return 100.0 * self.num_done / self.num_shards if self.num_shards else 100.0

    def _text(self) -> str:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        rate = self.num_tokens / elapsed
        eta = (self.tokens_left - self.num_tokens) / rate if rate > 0 else None  # no rate yet: 'ETA —'
        return (
            f"{self.num_done}/{self.num_shards} shards, {rate:,.0f} tokens/s, {eta_text(eta)}, "
            f"{self.num_bytes / 1e9:.2f} GB written"
        )

    def shard_done(self, result: ShardResult) -> None:
        """Count one finished shard (its tokens and bytes when it was computed, not found) and refresh the artifact."""
        self.num_done += 1
        self.num_tokens += result.num_tokens if result.computed else 0
        self.num_bytes += result.num_bytes if result.computed else 0
        update_progress_artifact(self.artifact_id, progress=self._percent(), description=self._text())


def _bounded(cfg: RunConfig, pending: list[int], max_in_flight: int) -> Iterator[PrefectFuture]:
    """Submit shard tasks keeping at most ``max_in_flight`` running; yield each as it finishes."""
    queue = list(pending)
    running: list[PrefectFuture] = []
    while queue or running:
        while queue and len(running) < max_in_flight:
            running.append(capture_shard_task.submit(cfg, queue.pop(0)))
        fut = next(as_completed(running))
        running.remove(fut)
        yield fut


@contextlib.contextmanager
def capture_endpoints(cfg: RunConfig) -> Iterator[RunConfig]:
    """For the SGLang backend without given endpoints: launch the servers once for all shards."""
    if cfg.capture.backend != "sglang" or cfg.capture.sglang.endpoints:
        yield cfg
        return
    from eagle3.features.run_spec import build_spec
    from eagle3.features.sglang_backend import managed_endpoints
    from eagle3.target.load import prepare_target

    model_dir = prepare_target(cfg)
    with managed_endpoints(cfg, model_dir, build_spec(cfg, model_dir)) as served:
        yield served


def run_capture_shards(cfg: RunConfig) -> StageOutcome:
    """Prepare, capture every pending shard (here with bounded concurrency, or in slice runs), finalize; a capture
    that is up to date only calls the finalize task, which Prefect answers ``Cached`` (tasks.stage_cache). The stage
    key is computed once, here, and handed to the finalize task."""
    key, complete = key_and_state(capture.STAGE.name, cfg)
    if complete:
        return finalize_capture_task(cfg, key)
    summary = prepare_capture_task(cfg)
    if not summary.pending:
        return finalize_capture_task(cfg, key)
    if cfg.capture.num_slices > 1:
        return run_capture_slices(cfg, summary, key)
    with capture_endpoints(cfg) as served:
        progress = CaptureProgress(cfg, summary)  # after the servers are up: tokens/s counts capture only
        _capture_list(served, summary.pending, progress.shard_done)
    return _finalize(cfg, key)


def _capture_list(cfg: RunConfig, shards: list[int], on_done: Callable[[ShardResult], None]) -> None:
    """Capture ``shards`` with bounded concurrency; RuntimeError naming the first failure after all have ended."""
    failures = []
    for fut in _bounded(cfg, shards, cfg.capture.max_concurrent_shards):
        fut.wait()  # fut.state is stale until wait()/result()
        if fut.state.is_completed():
            on_done(fut.result())
        else:
            failures.append(str(fut.state.message))
    if failures:
        raise RuntimeError(f"{len(failures)} capture shards failed; first: {failures[0]}")


def _finalize(cfg: RunConfig, key: str | None) -> StageOutcome:
    outcome = finalize_capture_task(cfg, key)
    publish_table(
        cfg,
        "capture-summary",
        [{k: v for k, v in outcome.stats.items() if not isinstance(v, (list, dict))}],
        "captured features",
    )
    return outcome


def run_capture_slices(
    cfg: RunConfig, summary: CaptureSummary, key: str | None = None, poll_s: float = 5.0
) -> StageOutcome:
    """Capture the pending shards as capture.num_slices slice runs on the gpu pool; finalize when all complete
    (``key``: the stage key, when computed already)."""
    from eagle3.features.capture import features_dir
    from eagle3.features.plan import PLAN_FILE, CapturePlan, split_slices

    plan = CapturePlan.load(features_dir(cfg) / PLAN_FILE)
    slices = split_slices(plan.shards, summary.pending, cfg.capture.num_slices)
    run_slices(
        SLICE_DEPLOYMENT,
        {k: {"config": cfg, "shards": shards} for k, shards in enumerate(slices)},
        f"capture-{cfg.run.name}",
        on_poll=_watch_disk(cfg, summary.pending, CaptureProgress(cfg, summary)),
        poll_s=poll_s,
    )
    return _finalize(cfg, key)


def _watch_disk(cfg: RunConfig, pending: list[int], progress: CaptureProgress) -> Callable[[], None]:
    """A poll that counts each pending shard into ``progress`` once its done file (written last) appears."""
    from eagle3.features.capture import ShardResult, features_dir
    from eagle3.features.shards.done import read_done
    from eagle3.features.shards.layout import done_path_for, shard_path

    fdir, left = features_dir(cfg), set(pending)

    def poll() -> None:
        for index in sorted(left):
            doc = read_done(done_path_for(shard_path(fdir, index)))
            if doc is not None:
                left.discard(index)
                progress.shard_done(ShardResult.from_done(index, doc, computed=True))  # by a slice run

    return poll


@flow(
    name="eagle3-capture",
    log_prints=True,
    task_runner=ThreadPoolTaskRunner(max_workers=MAX_THREADS),  # type: ignore[arg-type]  # Prefect types task_runner invariantly in its future type
    flow_run_name=stage_run_name(capture.STAGE.name),
)
@preset_gpu_note
def eagle3_capture(
    preset: PresetName = "smollm2-demo", overrides: list[str] | None = None, config: RunConfig | None = None
) -> dict[str, Any]:
    """Capture hidden states for a run whose tokenized data exists.

    Args:
        preset: Preset in configs/ that describes the run (target model, data, sizes); `tiny` runs in seconds.
        overrides: Dotted `section.field=value` changes to the preset, one per item, e.g.
            `["data.sources.0.max_records=1000", "train.num_epochs=1"]`.
        config: A full run configuration; when given, `preset` and `overrides` are ignored.

    Returns the capture manifest; a capture already complete ends in state ``Cached`` (its result: the manifest).
    """
    from infra.storage import run_lock

    guard_crash_loop()
    cfg = config or load_config(preset, list(overrides or []))
    get_run_logger().info("capturing into %s", run_layout(cfg).features.resolve())
    with run_lock(cfg.run_dir, owner="prefect flow eagle3-capture"):
        outcome = run_capture_shards(cfg)
    doc = read_manifest(outcome.manifest)  # the flow's result: the capture manifest
    assert doc is not None  # (the capture stage just wrote or matched it)
    if not outcome.computed:  # shown like every skipped stage; the caller still gets the manifest
        return Completed(
            name=UP_TO_DATE,
            data=doc,  # type: ignore[return-value]  # a flow returning a State ends in it
            message=f"capture up to date ({outcome.manifest})",
        )
    return doc


@flow(name="eagle3-capture-slice", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=MAX_THREADS))  # type: ignore[arg-type]  # Prefect types task_runner invariantly in its future type
def eagle3_capture_slice(config: RunConfig, shards: list[int]) -> None:
    """One slice of a capture (capture.num_slices > 1); eagle3-capture starts one run of it per slice.

    Args:
        config: The run's full configuration; its features/plan.json and spec.json are already written.
        shards: Indices of the planned shards this run captures (shards already complete are skipped).
    """
    import os
    import socket

    get_run_logger().info(
        "capturing %d shards %s on host %s (pid %d)", len(shards), shards[:8], socket.gethostname(), os.getpid()
    )
    with capture_endpoints(config) as served:
        _capture_list(served, list(shards), lambda result: None)
