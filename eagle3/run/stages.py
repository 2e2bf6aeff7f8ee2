"""Deprecated: the data stages moved to one module each (eagle3.data.stages.*), listed by eagle3.run.registry.

    python -m eagle3.run.stages tokenize --preset tiny     still works (= eagle3 stage tokenize --preset tiny)

The names below forward to their new homes for scripts written against this module.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from eagle3.config import RunConfig
from eagle3.data.stages import merge, regenerate, synthesize, tokenize, vocab
from eagle3.data.stages.common import kept_answer_sources, synthetic_sources
from eagle3.run.layout import run_layout, write_run_config
from eagle3.run.registry import DATA_STAGES, get_stage, run_data_block
from eagle3.run.stage import StageOutcome

__all__ = [
    "CLI",
    "data_dir",
    "is_complete",
    "kept_answer_sources",
    "key_for",
    "main",
    "manifest_path",
    "run_all",
    "run_merge",
    "run_regenerate",
    "run_regenerate_slice",
    "run_synthesize",
    "run_tokenize",
    "run_vocab",
    "synthetic_sources",
    "write_run_config",
]

CLI = "python -m eagle3.run.stages"
run_synthesize, run_merge, run_regenerate = synthesize.run, merge.run, regenerate.run
run_tokenize, run_vocab, run_regenerate_slice = tokenize.run, vocab.run, regenerate.run_slice


def data_dir(cfg: RunConfig) -> Path:
    """<run>/data."""
    return run_layout(cfg).data


def manifest_path(cfg: RunConfig, stage: str) -> Path:
    """Where a stage's manifest lives."""
    return get_stage(stage).manifest(cfg.run_dir)


def key_for(cfg: RunConfig, stage: str, fp: str | None = None) -> str:
    """The key of data stage ``stage`` (``fp``: ignored; each stage module fingerprints the target once)."""
    return get_stage(stage).key(cfg)


def is_complete(cfg: RunConfig, stage: str) -> bool:
    """True when the stage's manifest matches its current inputs."""
    return get_stage(stage).is_complete(cfg)


def run_all(cfg: RunConfig, force: bool = False) -> list[StageOutcome]:
    """Every data stage in order, under the run lock (eagle3.run.registry.run_data_block)."""
    from infra.storage import run_lock

    with run_lock(cfg.run_dir, owner=CLI):
        write_run_config(cfg)
        return run_data_block(cfg, force)


def main(argv: list[str] | None = None) -> Any:
    """python -m eagle3.run.stages {synthesize,merge,regenerate,tokenize,vocab,all} --preset NAME [--set k=v ...]"""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "all":
        from eagle3.run.registry import data_block_main

        return data_block_main(argv[1:])
    if argv and argv[0] in DATA_STAGES:
        return get_stage(argv[0]).main(argv[1:])
    raise SystemExit(f"usage: {main.__doc__}")


if __name__ == "__main__":
    print("note: python -m eagle3.run.stages is deprecated; use `eagle3 stage NAME` (same arguments)", file=sys.stderr)
    main()
