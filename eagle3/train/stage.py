"""The train stage: the drafter trained on the run's features (or online), resuming from its latest checkpoint.

    python -m eagle3.train --config runs/tiny/config.json        (one process; the same as ``eagle3 stage train``)
    python -m torch.distributed.run --standalone --nproc-per-node=8 -m eagle3.train --config <run>/config.json

The work is eagle3.train.loop's (the pipeline launches it under torchrun: tasks/train.py); this module is the
stage's face for eagle3.run.registry, imported without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eagle3.config import RunConfig
from eagle3.run.progress import ProgressFn
from eagle3.run.stage import StageOutcome, read_manifest
from eagle3.train import STAGE

__all__ = ["DESCRIPTION", "SECTION", "STAGE", "TORCHRUN", "headline", "key", "main", "run", "skip_reason"]

SECTION = "train"
DESCRIPTION = "train the drafter (torchrun; resumes from the latest checkpoint)"
TORCHRUN = True
"""The pipeline runs this stage as its own process group (torchrun), not in the flow's process."""


def skip_reason(cfg: RunConfig) -> str | None:
    """None: training always runs."""
    return None


def headline(result: Mapping[str, Any]) -> str:
    """The run summary's result cell (eagle3.run.summary): the last validation's acc_0 and acceptance estimate."""
    last = result.get("last_eval") or {}
    return f"val acc_0 {_fmt(last.get('acc_0'))}, accept_len_est {_fmt(last.get('accept_len_est'))}"


def _fmt(value: Any) -> str:
    """A figure to 3 decimals (floats), as given otherwise (None: "-")."""
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def key(cfg: RunConfig) -> str:
    """The train key: drafter + train config, seed, input manifests, target (eagle3.train.build.stage_key_for)."""
    from eagle3.train.build import key_for

    return key_for(cfg)


def run(
    cfg: RunConfig, progress: ProgressFn | None = None, force: bool = False, known_key: str | None = None
) -> StageOutcome | None:
    """Train in this process (world size 1; skipped when the manifest matches). Training resumes from its
    checkpoints, so ``force`` is refused: delete <run>/train to train from scratch. ``known_key``: the train key
    when the caller computed it already (eagle3.train.loop.train says what it trusts)."""
    from eagle3.train.loop import train

    if force:
        raise ValueError(
            f"the train stage resumes from its checkpoints and has no --force: delete "
            f"{cfg.run_dir / STAGE.folder} to train again from scratch"
        )
    result = train(cfg, known_key=known_key)
    manifest = STAGE.manifest(cfg.run_dir)
    doc = read_manifest(manifest)
    if result.status == "stopped" or doc is None:  # a signal stopped it before the last step: no manifest yet
        return None
    return StageOutcome.from_manifest(STAGE.name, doc["key"], manifest, doc, computed=result.status == "done")


def main(argv: list[str] | None = None) -> Any:
    """python -m eagle3.train --config <run>/config.json [--set k=v ...] [--stop-after-steps N]"""
    from eagle3.train.__main__ import main as train_main

    return train_main(argv)


if __name__ == "__main__":
    main()
