"""The vocab stage: the draft vocab map from the train split's assistant tokens.

python -m eagle3.data.stages.vocab --preset tiny
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eagle3.config import RunConfig, section_dict
from eagle3.data.stages import tokenize
from eagle3.data.stages.common import data_stage_main, target
from eagle3.run.layout import VOCAB_DIR, run_layout
from eagle3.run.progress import ProgressFn
from eagle3.run.stage import StageId, StageOutcome, run_stage, stage_key

STAGE = StageId("vocab", VOCAB_DIR)
SECTION = "vocab"
DESCRIPTION = "build the draft vocab map from the train split's assistant tokens"


def skip_reason(cfg: RunConfig) -> str | None:
    """None: vocab always runs."""
    return None


def headline(result: Mapping[str, Any]) -> str | None:
    """The run summary's result cell (eagle3.run.summary): the draft vocab's size and coverage (None: no counts)."""
    stats = result.get("stats") or {}
    if "draft_vocab_size" not in stats:
        return None
    return f"{stats['draft_vocab_size']} draft tokens, coverage {stats.get('coverage', float('nan')):.3f}"


def key(cfg: RunConfig, fp: str | None = None) -> str:
    """The vocab section, the tokenize manifest and the target (``fp``: its fingerprint when known)."""
    fp = fp or target(cfg)[1]
    return stage_key(STAGE, section_dict(cfg, SECTION), [tokenize.STAGE.manifest(cfg.run_dir)], {"target": fp})


def run(
    cfg: RunConfig, progress: ProgressFn | None = None, force: bool = False, known_key: str | None = None
) -> StageOutcome:
    """Build the draft vocab map from the train split's assistant tokens."""
    from eagle3.data.vocab import build_vocab_map
    from eagle3.target.load import load_tokenizer, stop_token_ids, target_info

    model_dir, fp = target(cfg)
    layout = run_layout(cfg)

    def compute():
        info = target_info(model_dir, cfg.target)
        forced = stop_token_ids(load_tokenizer(model_dir), info)
        return build_vocab_map(layout.tokenized, info.vocab_size, cfg.vocab.draft_vocab_size, forced, layout.vocab, fp)

    return run_stage(STAGE, STAGE.manifest(layout.root), known_key or key(cfg, fp), compute, force=force)


def main(argv: list[str] | None = None) -> None:
    """python -m eagle3.data.stages.vocab --preset NAME [--set k=v ...] [--force]"""
    data_stage_main(__spec__.name if __spec__ else __name__, argv)


if __name__ == "__main__":
    main()
