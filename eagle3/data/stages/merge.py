"""The merge stage: read, validate, dedupe, shuffle and split every source into data/merged.parquet.

python -m eagle3.data.stages.merge --preset tiny
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagle3.config import ConfigError, RunConfig, section_dict
from eagle3.data.stages import synthesize
from eagle3.data.stages.common import data_stage_main, synthetic_sources
from eagle3.run.layout import DATA_DIR, RunLayout, run_layout
from eagle3.run.progress import ProgressFn
from eagle3.run.stage import StageId, StageOutcome, run_stage, stage_key

STAGE = StageId("merge", DATA_DIR)
SECTION = "data"
DESCRIPTION = "read, validate, dedupe, shuffle and split every source into data/merged.parquet"


def output(layout: RunLayout) -> Path:
    """data/merged.parquet: the merged conversations (the run summary names it)."""
    return layout.merged


def skip_reason(cfg: RunConfig) -> str | None:
    """None: merge always runs."""
    return None


def headline(result: Mapping[str, Any]) -> str | None:
    """The run summary's result cell (eagle3.run.summary): conversations kept of those read (None: no totals)."""
    total = (result.get("stats") or {}).get("total")
    return f"kept {total.get('kept')} of {total.get('read')} conversations" if total else None


def key(cfg: RunConfig) -> str:
    """The data section, the seed, the synthesize manifest (with a synthetic source) and every source file's
    content. Operational fields are not in ``section_dict``: changing them redoes nothing."""
    conf = section_dict(cfg, SECTION) | {"seed": cfg.run.seed}
    inputs = [synthesize.STAGE.manifest(cfg.run_dir)] if synthetic_sources(cfg) else []
    return stage_key(STAGE, conf, inputs, extra={"source_files": source_hashes(cfg)})


def source_hashes(cfg: RunConfig) -> list[dict]:
    """Name, path and sha256 of each source file: changed content changes the merge key, also when an in-place
    copy (``cp -p``, ``rsync -a``, ``tar x``) kept the size and mtime. Hashed through infra.storage's cache, once
    per process and version of the file (device, inode, size, mtime, ctime)."""
    from eagle3.run.paths import resolve_path
    from infra.storage import sha256_file_cached

    hashes = []
    for src in cfg.data.sources:
        if src.path is None:
            continue  # a synthetic source: the synthesize manifest is the merge's input
        path = resolve_path(src.path)
        hashes.append(
            {"name": src.name, "path": str(path), "sha256": sha256_file_cached(path) if path.is_file() else None}
        )
    return hashes


def run(
    cfg: RunConfig, progress: ProgressFn | None = None, force: bool = False, known_key: str | None = None
) -> StageOutcome:
    """Read, validate, dedupe, shuffle and split every source into data/merged.parquet (``known_key``: the stage
    key when the caller computed it already)."""
    from eagle3.data.merge import merge_sources

    if not cfg.data.sources:
        raise ConfigError("data.sources is empty: nothing to merge (add a source in the preset or with --set)")
    layout = run_layout(cfg)
    return run_stage(
        STAGE,
        STAGE.manifest(layout.root),
        known_key or key(cfg),
        force=force,
        compute=lambda: merge_sources(cfg.data.sources, cfg.data, cfg.run.seed, layout.data, progress),
    )


def main(argv: list[str] | None = None) -> None:
    """python -m eagle3.data.stages.merge --preset NAME [--set k=v ...] [--force]"""
    data_stage_main(__spec__.name if __spec__ else __name__, argv)


if __name__ == "__main__":
    main()
