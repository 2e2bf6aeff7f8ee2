"""The tokenize stage: render with the target's chat template and compute assistant loss masks.

python -m eagle3.data.stages.tokenize --preset smollm2-demo --set tokenize.max_len=1024
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagle3.config import RunConfig, section_dict
from eagle3.data.stages import merge, regenerate
from eagle3.data.stages.common import data_stage_main, target
from eagle3.run.layout import DATA_DIR, RunLayout, run_layout
from eagle3.run.progress import ProgressFn
from eagle3.run.stage import StageId, StageOutcome, run_stage, stage_key

STAGE = StageId("tokenize", DATA_DIR, version=2)  # 2: the end-of-turn text of truncated turns is not supervised
SECTION = "tokenize"
DESCRIPTION = "render with the target's chat template and compute assistant loss masks"


def output(layout: RunLayout) -> Path:
    """data/tokenized.parquet: input ids and loss masks (the run summary names it)."""
    return layout.tokenized


def skip_reason(cfg: RunConfig) -> str | None:
    """None: tokenize always runs."""
    return None


def headline(result: Mapping[str, Any]) -> str | None:
    """The run summary's result cell (eagle3.run.summary): rows and tokens written (None: no counts)."""
    stats = result.get("stats") or {}
    return f"{stats['rows_written']} rows, {stats.get('num_tokens')} tokens" if "rows_written" in stats else None


def conversations_manifest(cfg: RunConfig) -> Path:
    """The manifest of the stage whose conversations get tokenized (regenerate when enabled, else merge)."""
    return (regenerate.STAGE if cfg.regenerate.enabled else merge.STAGE).manifest(cfg.run_dir)


def key(cfg: RunConfig, fp: str | None = None) -> str:
    """The tokenize section, the conversations' manifest and the target (``fp``: its fingerprint when known)."""
    fp = fp or target(cfg)[1]
    return stage_key(STAGE, section_dict(cfg, SECTION), [conversations_manifest(cfg)], {"target": fp})


def run(
    cfg: RunConfig, progress: ProgressFn | None = None, force: bool = False, known_key: str | None = None
) -> StageOutcome:
    """Render with the target's chat template and compute assistant loss masks into data/tokenized.parquet."""
    from eagle3.data.tokenize import tokenize_dataset
    from eagle3.target.load import load_tokenizer

    model_dir, fp = target(cfg)
    layout = run_layout(cfg)
    in_parquet = layout.regenerated if cfg.regenerate.enabled else layout.merged
    return run_stage(
        STAGE,
        STAGE.manifest(layout.root),
        known_key or key(cfg, fp),
        force=force,
        compute=lambda: tokenize_dataset(in_parquet, layout.data, load_tokenizer(model_dir), cfg.tokenize, progress),
    )


def main(argv: list[str] | None = None) -> None:
    """python -m eagle3.data.stages.tokenize --preset NAME [--set k=v ...] [--force]"""
    data_stage_main(__spec__.name if __spec__ else __name__, argv)


if __name__ == "__main__":
    main()
