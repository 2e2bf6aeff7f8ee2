"""The training flow: one GPU-tagged task that runs torchrun on the run's config (train.nnodes > 1: one flow
run of the eagle3-train-node deployment per node, flows/train_nodes.py).

Usable alone (deployment `eagle3-train`, for a run whose features are captured) and from the
pipeline. The trainer resumes from its latest checkpoint, so a retry or a crash-retry of the
flow continues training instead of starting over.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from eagle3.config import RunConfig, load_config
from eagle3.train import STAGE
from flows.common import PresetName, as_json, guard_crash_loop, preset_gpu_note
from flows.run_names import stage_run_name
from flows.train_nodes import train_nodes
from tasks.train import train_task


@flow(name="eagle3-train", log_prints=True, flow_run_name=stage_run_name(STAGE.name))
@preset_gpu_note
def eagle3_train(
    preset: PresetName = "smollm2-demo", overrides: list[str] | None = None, config: RunConfig | None = None
) -> dict[str, Any]:
    """Train the drafter for a run whose vocab map and captured features exist.

    Args:
        preset: Preset in configs/ that describes the run (target model, data, sizes); `tiny` runs in seconds.
        overrides: Dotted `section.field=value` changes to the preset, one per item, e.g.
            `["data.sources.0.max_records=1000", "train.num_epochs=1"]`.
        config: A full run configuration; when given, `preset` and `overrides` are ignored.
    """
    from infra.storage import run_lock

    guard_crash_loop()
    cfg = config or load_config(preset, list(overrides or []))
    with run_lock(cfg.run_dir, owner="prefect flow eagle3-train"):
        return as_json(train_nodes(cfg) if cfg.train.nnodes > 1 else train_task(cfg))
