"""The synthesize stage: the target writes and answers the records of every synthetic source.

python -m eagle3.data.stages.synthesize --preset smollm2-curve
"""

from __future__ import annotations

from pathlib import Path

from eagle3.config import RunConfig
from eagle3.data.stages.common import data_stage_main, model_loader, synthetic_sources, target
from eagle3.run.layout import DATA_DIR, RunLayout, run_layout
from eagle3.run.progress import ProgressFn
from eagle3.run.stage import StageId, StageOutcome, run_stage, stage_key

STAGE = StageId("synthesize", DATA_DIR)
SECTION: str | None = None  # the key hashes the synthetic sources and the generation settings (stage_config)
DESCRIPTION = "let the target write and answer the records of the synthetic sources"


def output(layout: RunLayout) -> Path:
    """data/synthetic/: the generated records, one file per synthetic source (the run summary names it)."""
    from eagle3.data.synthetic import SYNTHETIC_DIR

    return layout.data / SYNTHETIC_DIR


def skip_reason(cfg: RunConfig) -> str | None:
    """Why the stage has nothing to do for ``cfg`` (None: it runs)."""
    return None if synthetic_sources(cfg) else "no synthetic source among data.sources"


def generating(cfg: RunConfig, fp: str) -> str:
    """The generating target: its fingerprint and the dtype it is loaded in (the dtype changes the text too)."""
    return f"{fp}:{cfg.target.dtype}"


def key(cfg: RunConfig, fp: str | None = None) -> str:
    """The stage key: the synthetic sources' generation settings and the generating target (``fp``: its
    fingerprint when the caller has it)."""
    from eagle3.data.synthesize import stage_config

    fp = fp or target(cfg)[1]
    return stage_key(STAGE, stage_config(synthetic_sources(cfg), cfg.regenerate), [], {"target": generating(cfg, fp)})


def run(
    cfg: RunConfig, progress: ProgressFn | None = None, force: bool = False, known_key: str | None = None
) -> StageOutcome | None:
    """Let the target write and answer the records of every synthetic source (None when there is none;
    ``known_key``: the stage key when the caller computed it already)."""
    sources = synthetic_sources(cfg)
    if not sources:
        return None
    from eagle3.data.synthesize import synthesize

    model_dir, fp = target(cfg)
    layout = run_layout(cfg)

    def compute():
        return synthesize(
            sources, layout.data, cfg.regenerate, model_loader(cfg, model_dir), generating(cfg, fp), progress
        )

    return run_stage(STAGE, STAGE.manifest(layout.root), known_key or key(cfg, fp), compute, force=force)


def main(argv: list[str] | None = None) -> None:
    """python -m eagle3.data.stages.synthesize --preset NAME [--set k=v ...] [--force]"""
    data_stage_main(__spec__.name if __spec__ else __name__, argv)


if __name__ == "__main__":
    main()
