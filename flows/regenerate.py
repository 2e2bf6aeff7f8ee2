"""Regeneration across hosts: with regenerate.num_slices = N above 1 the pipeline's regenerate step fans out.

The parent (the regenerate step of `eagle3-pipeline` and of `eagle3-data`, which is the same flow) plans N disjoint
slices of the conversations left to regenerate (eagle3.data.regenerate_slices) and submits each as a run of the
`eagle3-regenerate-slice` deployment on the gpu pool (flows.common.run_slices), so N workers (one per host, each
with its own endpoint client or in-process target) answer at once, each into its own journal in the shared run
directory. The parent counts answered conversations over all slice journals into one progress artifact, submits
a slice again when its run ends Crashed or Failed (it skips what its journal already has), and writes the outputs
and the manifest only once every planned conversation has an answer or an error. Slice runs take no run lock:
the parent holds it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

from prefect import flow, get_run_logger

from eagle3.config import RunConfig
from eagle3.run.stage import StageOutcome
from flows.common import as_json, run_slices
from tasks.artifacts import ProgressArtifact, artifact_key
from tasks.data import regenerate_slice_task

SLICE_DEPLOYMENT = "eagle3-regenerate-slice/eagle3-regenerate-slice"


def regenerate_in_slices(cfg: RunConfig, force: bool = False, poll_s: float = 5.0) -> StageOutcome:
    """The regenerate stage with its conversations answered by regenerate.num_slices slice runs; its outcome."""
    from eagle3.data.stages import regenerate

    def run(num_slices: int, poll: Callable[[], None]) -> None:
        run_slices(
            SLICE_DEPLOYMENT,
            {k: {"config": cfg, "index": k} for k in range(num_slices)},
            f"regenerate-{cfg.run.name}",
            on_poll=poll,
            poll_s=poll_s,
        )

    description = f"regenerate ({cfg.run.name}, {cfg.regenerate.num_slices} slices)"
    with ProgressArtifact(artifact_key(cfg, regenerate.STAGE.name), description) as progress:
        outcome = regenerate.run(cfg, progress.callback, force, run_slices=run)
        assert outcome is not None  # (called with regeneration on)
        return outcome


@flow(name="eagle3-regenerate-slice", log_prints=True)
def eagle3_regenerate_slice(config: RunConfig, index: int) -> dict[str, Any]:
    """One slice of a regeneration (regenerate.num_slices > 1); the pipeline's regenerate step starts one run per slice.

    Args:
        config: The run's full configuration; its data/regenerate.slices.json is already written.
        index: Which slice of that plan this run answers (conversations already in its journal are skipped).
    """
    get_run_logger().info("regenerating slice %d on host %s (pid %d)", index, socket.gethostname(), os.getpid())
    return as_json(regenerate_slice_task(config, index))
