"""The regenerate stage: every user turn re-answered by the target (when regenerate.enabled).

python -m eagle3.data.stages.regenerate --preset smollm2-demo --set regenerate.enabled=true
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3.config import RunConfig, section_dict
from eagle3.data.stages import merge
from eagle3.data.stages.common import data_stage_main, kept_answer_sources, model_loader, target
from eagle3.run.layout import DATA_DIR, RunLayout, run_layout
from eagle3.run.progress import ProgressFn
from eagle3.run.stage import StageId, StageOutcome, run_stage, stage_key

if TYPE_CHECKING:
    from eagle3.data.chat_backends import ChatBackend
    from eagle3.data.regenerate_slices import SliceRunner, SliceStats

STAGE = StageId("regenerate", DATA_DIR, version=2)  # 2: regenerated.parquet holds truncated_turns
SECTION = "regenerate"
DESCRIPTION = "re-answer every user turn with the target"


def output(layout: RunLayout) -> Path:
    """data/regenerated.parquet: the conversations re-answered by the target (the run summary names it)."""
    return layout.regenerated


def skip_reason(cfg: RunConfig) -> str | None:
    """Why the stage has nothing to do for ``cfg`` (None: it runs)."""
    return None if cfg.regenerate.enabled else "regenerate.enabled is false"


def key(cfg: RunConfig, fp: str | None = None) -> str:
    """The regenerate section, the merge manifest and the target (``fp``: its fingerprint when known)."""
    fp = fp or target(cfg)[1]
    return stage_key(STAGE, section_dict(cfg, SECTION), [merge.STAGE.manifest(cfg.run_dir)], {"target": fp})


def run(
    cfg: RunConfig,
    progress: ProgressFn | None = None,
    force: bool = False,
    known_key: str | None = None,
    run_slices: SliceRunner | None = None,
) -> StageOutcome | None:
    """Re-answer every user turn with the target (None when regeneration is off).

    With regenerate.num_slices above 1 and a ``run_slices`` (the flows pass one that starts a flow run per slice),
    the conversations left are split into slices that ``run_slices`` has answered elsewhere (``run_slice``), and
    this process only plans and merges; without ``run_slices`` everything is answered here."""
    if not cfg.regenerate.enabled:
        return None
    from eagle3.data.regenerate import regenerate
    from eagle3.data.regenerate_slices import regenerate_sliced

    model_dir, fp = target(cfg)
    own = kept_answer_sources(cfg)
    layout = run_layout(cfg)

    def compute():
        if run_slices is not None and cfg.regenerate.num_slices > 1:
            return regenerate_sliced(layout.merged, layout.data, cfg.regenerate, run_slices, progress, keep_sources=own)
        with chat_backend(cfg, model_dir) as backend:
            return regenerate(layout.merged, layout.data, cfg.regenerate, backend, progress, keep_sources=own)

    return run_stage(STAGE, STAGE.manifest(layout.root), known_key or key(cfg, fp), compute, force=force)


def run_slice(cfg: RunConfig, index: int, progress: ProgressFn | None = None) -> SliceStats:
    """Answer slice ``index`` of a sliced regeneration planned by ``run`` (its stats)."""
    from eagle3.data.regenerate_slices import regenerate_slice

    model_dir, _ = target(cfg)
    layout = run_layout(cfg)
    with chat_backend(cfg, model_dir) as backend:
        return regenerate_slice(layout.merged, layout.data, cfg.regenerate, backend, index, progress)


@contextlib.contextmanager
def chat_backend(cfg: RunConfig, model_dir: Path) -> Iterator[ChatBackend]:
    """The regenerate backend while regeneration runs: an endpoint client, the target loaded here (hf), or a
    client on an SGLang server started here and stopped on the way out (sglang: eagle3.data.sglang_chat)."""
    from eagle3.data.regenerate import make_backend

    if cfg.regenerate.backend == "sglang":
        from eagle3.data.sglang_chat import managed_chat_backend

        with managed_chat_backend(cfg, model_dir) as client:
            yield client
        return
    model, tok = model_loader(cfg, model_dir)() if cfg.regenerate.backend == "hf" else (None, None)
    yield make_backend(cfg.regenerate, model=model, tokenizer=tok)


def main(argv: list[str] | None = None) -> None:
    """python -m eagle3.data.stages.regenerate --preset NAME [--set k=v ...] [--force]"""
    data_stage_main(__spec__.name if __spec__ else __name__, argv)


if __name__ == "__main__":
    main()
