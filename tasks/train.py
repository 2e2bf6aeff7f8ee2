"""The GPU-tagged training task: torchrun under supervision, live progress, metrics and plots at the end.

Retries are safe because the trainer resumes from its latest checkpoint. A training whose manifest matches its
inputs is up to date: the task's cache key (tasks.stage_cache) answers ``Cached`` before the task starts, so no
torchrun is launched and no progress is published (the task also checks again itself before launching one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from eagle3.config import RunConfig
from eagle3.run.layout import run_layout
from eagle3.run.progress import eta_text, fmt
from eagle3.train import STAGE
from tasks.artifacts import artifact_key, markdown_image, publish_table
from tasks.cancel import cancellable
from tasks.stage_cache import STAGE_CACHE, computed_key, key_and_state, stage_cache_key


def torchrun_spec(
    cfg: RunConfig, config_path: Path, num_gpus: int, node_rank: int | None = None, known_key: str | None = None
):
    """The torchrun command for this run (node ``node_rank``, default train.node_rank): nproc = configured, else one
    per visible GPU, else 1; with train.nnodes > 1 the nodes meet at train.rdzv_endpoint (c10d). ``known_key``: the
    train key of ``cfg`` (the file at ``config_path`` holds exactly ``cfg``), handed to every rank so that none
    computes it again; without one each rank computes it."""
    from infra.torchrun import TorchrunSpec

    nproc = cfg.train.nproc_per_node or max(1, num_gpus)
    rank = cfg.train.node_rank if node_rank is None else node_rank
    # Without a GPU, torch's default threads (every core). The first 10 steps of smollm2-demo's training
    # (`OMP_NUM_THREADS=N python -m eagle3.train --config <run>/config.json --stop-after-steps 10`) on the 2-core
    # machine with the demo's Prefect server and both workers running: 43.7 and 44.4 s at 2 threads, 72.7 and 73.0 s
    # at 1 (docs/log.md). Only under other heavy load (load average 4-7) was 1 thread faster.
    args = ("--config", str(config_path.resolve()), *(("--known-key", known_key) if known_key else ()))
    return TorchrunSpec(
        module="eagle3.train",
        args=args,
        nproc_per_node=nproc,
        nnodes=cfg.train.nnodes,
        node_rank=rank,
        rdzv_endpoint=cfg.train.rdzv_endpoint,
        rdzv_id=f"eagle3-{cfg.run.name}",
    )


def torchrun_log(cfg: RunConfig, node_rank: int) -> Path:
    """The torchrun log of one node: torchrun.log on a single node, torchrun.node<R>.log per node otherwise
    (the nodes share the run directory, and the pid file beside the log must name this node's torchrun only)."""
    name = "torchrun.log" if cfg.train.nnodes == 1 else f"torchrun.node{node_rank}.log"
    return run_layout(cfg).train / name


def _visible_gpus(cfg: RunConfig) -> list:
    """GPUs this task may use, checked free (named processes holding memory stop the run)."""
    from infra.gpus import check_gpus_free, list_gpus

    gpus = [] if cfg.train.device == "cpu" else list_gpus()
    if gpus:
        check_gpus_free([g.index for g in gpus], allow_shared=cfg.capture.allow_shared_gpus, gpus=gpus)
    return gpus


STALE_SLACK_S = 2.0
"""How far a progress.json's modification time may lie before the watcher's start and still count as this run's
(the run directory may sit on a file server whose clock is a little behind)."""


def progress_text(doc: dict[str, Any]) -> str:
    """One line of train/progress.json: 'running: step 3/10, loss 4.1234, acc_0 0.125, 1,234 tok/s, ETA 12 s'; a
    value not known yet (before the first step, NaN) is left out and an unknown ETA reads 'ETA \u2014', never nan."""
    total, step = doc.get("total_steps") or 0, doc.get("step") or 0
    parts = [f"{doc.get('state') or 'starting'}: step {step}/{total}"]
    for label, key, spec in (("loss", "loss", ".4f"), ("acc_0", "acc_0", ".3f")):
        if (value := fmt(doc.get(key), spec)) is not None:
            parts.append(f"{label} {value}")
    if (rate := fmt(doc.get("tokens_per_s"), ",.0f")) is not None and doc["tokens_per_s"] > 0:
        parts.append(f"{rate} tok/s")
    parts.append(eta_text(doc.get("eta_s")))
    return ", ".join(parts)


class ProgressWatcher:
    """Polls train/progress.json in a thread and mirrors it into a progress artifact."""

    def __init__(self, cfg: RunConfig, every_s: float = 5.0):
        self.path = run_layout(cfg).progress
        self.every_s = every_s
        self.started = time.time() - STALE_SLACK_S  # a progress.json older than this is an earlier run's
        self.stop = threading.Event()
        # Called from sync code, Prefect's async_dispatch returns the id itself (its type also names a coroutine).
        self.artifact_id = cast(
            UUID,
            create_progress_artifact(0.0, key=artifact_key(cfg, "train-progress"), description="training: starting"),
        )
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(self.every_s):
            self.refresh()

    def refresh(self) -> None:
        try:
            if self.path.stat().st_mtime < self.started:
                return  # left by an earlier training: not this run's progress
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        total, step = doc.get("total_steps") or 0, doc.get("step") or 0
        update_progress_artifact(
            self.artifact_id, progress=100.0 * step / total if total else 0.0, description=progress_text(doc)
        )

    def __enter__(self) -> ProgressWatcher:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.refresh()


@dataclass(frozen=True)
class TrainSummary:
    """What a finished training reports: its manifest's stats and the last train and validation records."""

    manifest: dict[str, Any]
    last_train: dict[str, Any] | None
    last_eval: dict[str, Any] | None
    computed: bool | None = None
    """False: the training was up to date and nothing ran; True: torchrun ran; None: not known."""

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (what the flows return)."""
        return {
            "manifest": self.manifest,
            "last_train": self.last_train,
            "last_eval": self.last_eval,
            "computed": self.computed,
        }


def publish_train_report(cfg: RunConfig) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Table of the last train/eval metrics and a markdown report with the loss/acc PNGs embedded; returns
    (last train record, last validation record)."""
    from eagle3.train.plots import plot_metrics, read_metrics

    metrics = run_layout(cfg).metrics
    train, evals = read_metrics(metrics)
    rows = [{"split": "train", "step": train[-1].get("step"), **_scalars(train[-1])}] if train else []
    rows += [{"split": "val", "step": r.get("step"), **_scalars(r)} for r in evals]
    publish_table(
        cfg, "train-metrics", rows or [{"split": "(none)"}], "last train step and every validation", index=2
    )  # split, step
    images = "\n\n".join(markdown_image(p) for p in plot_metrics(metrics))
    create_markdown_artifact(
        markdown=f"# Training `{cfg.run.name}`\n\n{images}\n",
        key=artifact_key(cfg, "train-report"),
        description="loss and accuracy per TTT step",
    )
    return (train[-1] if train else None), (evals[-1] if evals else None)


def _scalars(record: dict[str, Any]) -> dict[str, Any]:
    return {
        k: round(v, 5) if isinstance(v, float) else v
        for k, v in record.items()
        if isinstance(v, (int, float, str)) and not k.startswith("num_supervised")
    }


def skipped_train(cfg: RunConfig, key: str) -> TrainSummary:
    """The summary of an up-to-date training, read from its manifest and metrics (nothing published)."""
    from eagle3.run.stage import read_manifest
    from eagle3.train.plots import read_metrics

    manifest = read_manifest(STAGE.manifest(cfg.run_dir)) or {}
    train, evals = read_metrics(run_layout(cfg).metrics)
    return TrainSummary(
        manifest.get("stats", {}), train[-1] if train else None, evals[-1] if evals else None, computed=False
    )


@task(
    name=STAGE.name,
    tags=["gpu"],
    retries=2,
    retry_delay_seconds=[30, 120],
    task_run_name="train-{cfg.run.name}",
    cache_key_fn=stage_cache_key(STAGE.name, skipped_train),
    **STAGE_CACHE,
)
def train_task(cfg: RunConfig) -> TrainSummary:
    """Train the drafter with torchrun (resuming from the latest checkpoint); returns the manifest summary.

    Up to date (the manifest matches the train key): Prefect answers ``Cached`` from the cache key; should the task
    run all the same (the key function found it out of date, or Prefect's cache was bypassed), it checks the latter
    case first and returns the summary without starting torchrun.

    The train key is computed once: by the key function (or here, when it computed none) and handed to torchrun's
    ranks as ``--known-key``. They take it unchecked; what makes it right is that it was computed from the config
    written for them, under the run lock that the calling flow (flows/train.py, flows/pipeline.py) holds until
    torchrun ends, so no input stage changes in between. This task is the only caller that passes a key."""
    key = computed_key()  # the key function found the training out of date just now
    if key is None:
        key, complete = key_and_state(STAGE.name, cfg)
        if complete and key is not None:
            get_run_logger().info("train: up to date (%s), no process started", STAGE.manifest(cfg.run_dir))
            return skipped_train(cfg, key)
    run_node(cfg, cfg.train.node_rank, key)
    return dataclasses.replace(train_summary(cfg), computed=True)


def run_node(cfg: RunConfig, node_rank: int, known_key: str | None = None) -> None:
    """This node's torchrun to completion; node 0 mirrors train/progress.json (written by global rank 0).
    ``known_key``: the train key of ``cfg``, when computed already (train_task)."""
    from eagle3.run.layout import write_run_config
    from infra.torchrun import run_torchrun

    logger = get_run_logger()
    spec = torchrun_spec(cfg, write_run_config(cfg), len(_visible_gpus(cfg)), node_rank, known_key)
    logger.info("launching %s", " ".join(spec.argv()))
    with ProgressWatcher(cfg) if node_rank == 0 else contextlib.nullcontext():
        run_torchrun(spec, torchrun_log(cfg, node_rank), timeout_s=cfg.train.timeout_s, on_line=logger.info)


def train_summary(cfg: RunConfig) -> TrainSummary:
    """The manifest stats and the metrics report of a finished training."""
    from eagle3.run.stage import read_manifest

    manifest = read_manifest(STAGE.manifest(cfg.run_dir)) or {}
    return TrainSummary(manifest.get("stats", {}), *publish_train_report(cfg))


@task(name="train-node", retries=0, task_run_name="train-{cfg.run.name}-node{node_rank}")
def train_node_task(cfg: RunConfig, node_rank: int) -> None:
    """One node of a multi-node training: its torchrun joins the others at train.rdzv_endpoint.

    No task retries: a node that restarted alone would wait at a rendezvous the others have left; the
    parent flow re-submits all nodes together, and the trainer resumes from the newest checkpoint. No `gpu`
    tag either (flows/train_nodes.py says why)."""
    run_node(cfg, node_rank)


# A cancelled flow run ends these task runs Cancelled, not Crashed, once infra.torchrun has stopped torchrun and
# every rank (seconds: STOP_GRACE_S); the flow run still ends Cancelled (tasks.cancel).
train_task = cancellable(train_task)
train_node_task = cancellable(train_node_task)
