"""The capture stage: the target's hidden states of every tokenized sample, in resumable, validated shards.

    python -m eagle3.features.capture --preset tiny        (the same as ``eagle3 stage capture``)

The work is eagle3.features.capture's (prepare, one shard at a time, finalize); this module is the stage's face
for eagle3.run.registry, imported without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eagle3.config import RunConfig
from eagle3.features import ONLINE_SKIP, STAGE
from eagle3.run.progress import ProgressFn
from eagle3.run.stage import StageOutcome

__all__ = [
    "DESCRIPTION",
    "ONLINE_SKIP",
    "SECTION",
    "STAGE",
    "headline",
    "key",
    "main",
    "run",
    "skip_reason",
    "up_to_date",
]

SECTION = "capture"
DESCRIPTION = "capture the target's hidden states of every tokenized sample, in shards"


def skip_reason(cfg: RunConfig) -> str | None:
    """Why the stage has nothing to do for ``cfg`` (None: it runs): a run that trains online captures nothing."""
    return ONLINE_SKIP if cfg.train.features == "online" else None


def headline(result: Mapping[str, Any]) -> str:
    """The run summary's result cell (eagle3.run.summary): shards, tokens and megabytes captured."""
    stats = result.get("stats") or {}
    megabytes = stats.get("num_bytes", 0) / 1e6
    return f"{stats.get('num_shards')} shards, {stats.get('num_tokens')} tokens, {megabytes:.1f} MB"


def key(cfg: RunConfig) -> str:
    """The capture key: capture section, target dtype, tokenize manifest, target and feature spec."""
    from eagle3.features.capture import stage_key_of

    return stage_key_of(cfg)


def up_to_date(cfg: RunConfig, key: str) -> bool:
    """The manifest matches ``key`` and every shard it vouches for is on disk."""
    from eagle3.features.capture import is_complete

    return is_complete(cfg, key)


def run(
    cfg: RunConfig, progress: ProgressFn | None = None, force: bool = False, known_key: str | None = None
) -> StageOutcome | None:
    """Prepare, capture every missing shard, finalize (None when the run trains online)."""
    from eagle3.features.capture import run_capture

    return None if skip_reason(cfg) else run_capture(cfg, progress, force, known_key)


def main(argv: list[str] | None = None) -> Any:
    """python -m eagle3.features.capture --preset NAME [--set k=v ...] [--force]"""
    from eagle3.features.capture import main as capture_main

    return capture_main(argv)


if __name__ == "__main__":
    main()
