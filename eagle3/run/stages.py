"""The data stages as whole, skippable steps over a run directory (no Prefect here).

Each ``run_*`` computes its stage key (eagle3.run.stage), returns at once when the manifest
matches, and otherwise computes the outputs and writes the manifest last. Prefect tasks and
``python -m eagle3.run.stages`` call exactly these functions, so a run behaves the same with or
without an orchestrator.

    python -m eagle3.run.stages all --preset tiny
    python -m eagle3.run.stages tokenize --preset smollm2-demo --set tokenize.max_len=1024
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3.config import ConfigError, RunConfig, SourceConfig, section_dict
from eagle3.run.layout import run_layout, write_run_config  # noqa: F401 (write_run_config: the name callers know)
from eagle3.run.progress import ProgressFn
from eagle3.run.registry import DATA_STAGES, get_stage
from eagle3.run.stage import StageOutcome, run_stage, stage_key

if TYPE_CHECKING:
    from eagle3.data.regenerate_slices import SliceRunner, SliceStats


def data_dir(cfg: RunConfig) -> Path:
    """<run>/data."""
    return run_layout(cfg).data


def manifest_path(cfg: RunConfig, stage: str) -> Path:
    """Where a stage's manifest lives (eagle3.run.layout)."""
    return run_layout(cfg).manifest(stage)


def key_for(cfg: RunConfig, stage: str, fp: str | None = None) -> str:
    """The stage key (eagle3.run.stage); Prefect's cache key for the stage's task is this same string.

    ``fp`` is the target fingerprint when the caller has it already (else it is computed here). Operational
    fields (regenerate.num_slices) are not in ``section_dict``: changing them redoes nothing.
    """
    if stage == "merge":
        conf = section_dict(cfg, "data") | {"seed": cfg.run.seed}
        inputs = [manifest_path(cfg, "synthesize")] if synthetic_sources(cfg) else []
        return stage_key("merge", conf, inputs, extra={"source_files": _source_hashes(cfg)})
    fp = fp or _target(cfg)[1]
    if stage == "synthesize":
        from eagle3.data.synthesize import stage_config

        conf = stage_config(synthetic_sources(cfg), cfg.regenerate)
        return stage_key(stage, conf, [], {"target": _generating(cfg, fp)})
    upstream = {"regenerate": manifest_path(cfg, "merge"), "tokenize": _conversations_manifest(cfg),
                "vocab": manifest_path(cfg, "tokenize")}[stage]
    return stage_key(stage, section_dict(cfg, stage), [upstream], {"target": fp})


def _generating(cfg: RunConfig, fp: str) -> str:
    """The generating target: its fingerprint and the dtype it is loaded in (the dtype changes the text too)."""
    return f"{fp}:{cfg.target.dtype}"


def is_complete(cfg: RunConfig, stage: str) -> bool:
    """True when the stage's manifest matches its current inputs (a re-run would skip it)."""
    return get_stage(stage).is_complete(cfg)


def synthetic_sources(cfg: RunConfig) -> list[SourceConfig]:
    """The data sources the target writes itself (format synthetic), in config order."""
    return [src for src in cfg.data.sources if src.format == "synthetic"]


def kept_answer_sources(cfg: RunConfig) -> frozenset[str]:
    """Sources whose rows regeneration copies as they are: synthetic ones (the target wrote their answers) and
    those with keep_answers."""
    return frozenset(src.name for src in cfg.data.sources if src.format == "synthetic" or src.keep_answers)


def run_synthesize(cfg: RunConfig, progress: ProgressFn | None = None, force: bool = False) -> StageOutcome | None:
    """Let the target write and answer the records of every synthetic source (None when there is none)."""
    sources = synthetic_sources(cfg)
    if not sources:
        return None
    from eagle3.data.synthesize import synthesize

    model_dir, fp = _target(cfg)

    def compute():
        return synthesize(sources, data_dir(cfg), cfg.regenerate, _model_loader(cfg, model_dir), _generating(cfg, fp),
                          progress)

    return run_stage("synthesize", manifest_path(cfg, "synthesize"), key_for(cfg, "synthesize", fp), compute,
                     force=force)


def _model_loader(cfg: RunConfig, model_dir: Path):
    """A function that loads the target and its tokenizer for in-process generation (regenerate.device)."""
    def load():
        from eagle3.target.load import load_model, load_tokenizer

        return load_model(model_dir, cfg.target.dtype, cfg.regenerate.device), load_tokenizer(model_dir)

    return load


def run_merge(cfg: RunConfig, progress: ProgressFn | None = None, force: bool = False) -> StageOutcome:
    """Read, validate, dedupe, shuffle and split every source into data/merged.parquet."""
    from eagle3.data.merge import merge_sources

    if not cfg.data.sources:
        raise ConfigError("data.sources is empty: nothing to merge (add a source in the preset or with --set)")
    return run_stage("merge", manifest_path(cfg, "merge"), key_for(cfg, "merge"), force=force,
                     compute=lambda: merge_sources(cfg.data.sources, cfg.data, cfg.run.seed, data_dir(cfg), progress))


def _source_hashes(cfg: RunConfig) -> list[dict]:
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
        hashes.append({"name": src.name, "path": str(path),
                       "sha256": sha256_file_cached(path) if path.is_file() else None})
    return hashes


def _conversations_manifest(cfg: RunConfig) -> Path:
    """The manifest of the stage whose conversations get tokenized."""
    return manifest_path(cfg, "regenerate" if cfg.regenerate.enabled else "merge")


def _target(cfg: RunConfig) -> tuple[Path, str]:
    from eagle3.target.load import fingerprint, prepare_target

    model_dir = prepare_target(cfg)
    return model_dir, fingerprint(model_dir)


def run_regenerate(cfg: RunConfig, progress: ProgressFn | None = None, force: bool = False,
                   run_slices: SliceRunner | None = None) -> StageOutcome | None:
    """Re-answer every user turn with the target (None when regeneration is off).

    With regenerate.num_slices above 1 and a ``run_slices`` (the flows pass one that starts a flow run per slice),
    the conversations left are split into slices that ``run_slices`` has answered elsewhere (``run_regenerate_slice``),
    and this process only plans and merges; without ``run_slices`` everything is answered here."""
    if not cfg.regenerate.enabled:
        return None
    from eagle3.data.regenerate import regenerate
    from eagle3.data.regenerate_slices import regenerate_sliced

    model_dir, fp = _target(cfg)
    key = key_for(cfg, "regenerate", fp)
    own = kept_answer_sources(cfg)
    in_parquet = run_layout(cfg).merged

    def compute():
        if run_slices is not None and cfg.regenerate.num_slices > 1:
            return regenerate_sliced(in_parquet, data_dir(cfg), cfg.regenerate, run_slices, progress, keep_sources=own)
        return regenerate(in_parquet, data_dir(cfg), cfg.regenerate, _chat_backend(cfg, model_dir), progress,
                          keep_sources=own)

    return run_stage("regenerate", manifest_path(cfg, "regenerate"), key, compute, force=force)


def run_regenerate_slice(cfg: RunConfig, index: int, progress: ProgressFn | None = None) -> SliceStats:
    """Answer slice ``index`` of a sliced regeneration planned by ``run_regenerate`` (its stats)."""
    from eagle3.data.regenerate_slices import regenerate_slice

    model_dir, _ = _target(cfg)
    return regenerate_slice(run_layout(cfg).merged, data_dir(cfg), cfg.regenerate,
                            _chat_backend(cfg, model_dir), index, progress)


def _chat_backend(cfg: RunConfig, model_dir: Path):
    """The regenerate backend: an endpoint client, or the target loaded here (hf)."""
    from eagle3.data.regenerate import make_backend

    model, tok = _model_loader(cfg, model_dir)() if cfg.regenerate.backend == "hf" else (None, None)
    return make_backend(cfg.regenerate, model=model, tokenizer=tok)


def run_tokenize(cfg: RunConfig, progress: ProgressFn | None = None, force: bool = False) -> StageOutcome:
    """Render with the target's chat template and compute assistant loss masks."""
    from eagle3.data.tokenize import tokenize_dataset
    from eagle3.target.load import load_tokenizer

    model_dir, fp = _target(cfg)
    key = key_for(cfg, "tokenize", fp)
    layout = run_layout(cfg)
    in_parquet = layout.regenerated if cfg.regenerate.enabled else layout.merged
    return run_stage("tokenize", manifest_path(cfg, "tokenize"), key, force=force, compute=lambda: tokenize_dataset(
        in_parquet, data_dir(cfg), load_tokenizer(model_dir), cfg.tokenize, progress))


def run_vocab(cfg: RunConfig, progress: ProgressFn | None = None, force: bool = False) -> StageOutcome:
    """Build the draft vocab map from train-split assistant tokens."""
    from eagle3.data.vocab import build_vocab_map
    from eagle3.target.load import load_tokenizer, stop_token_ids, target_info

    model_dir, fp = _target(cfg)
    key = key_for(cfg, "vocab", fp)

    def compute():
        info = target_info(model_dir, cfg.target)
        forced = stop_token_ids(load_tokenizer(model_dir), info)
        layout = run_layout(cfg)
        return build_vocab_map(layout.tokenized, info.vocab_size, cfg.vocab.draft_vocab_size, forced, layout.vocab, fp)

    return run_stage("vocab", manifest_path(cfg, "vocab"), key, compute, force=force)


def run_all(cfg: RunConfig, force: bool = False) -> list[StageOutcome]:
    """Every data stage in order (what the pipeline flow does, without Prefect)."""
    from infra.storage import run_lock

    with run_lock(cfg.run_dir, owner=CLI):
        write_run_config(cfg)
        return _run_all(cfg, force)


def _run_all(cfg: RunConfig, force: bool) -> list[StageOutcome]:
    outcomes = [get_stage(name).run(cfg, force=force) for name in DATA_STAGES]
    return [o for o in outcomes if o is not None]


CLI = "python -m eagle3.run.stages"


def main(argv: list[str] | None = None) -> None:
    """python -m eagle3.run.stages {synthesize,merge,regenerate,tokenize,vocab,all} --preset NAME [--set k=v ...]"""
    from eagle3.run.cli_args import add_config_args, stage_main

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("stage", choices=(*DATA_STAGES, "all"))
    parser.add_argument("--force", action="store_true", help="recompute even if the manifest matches")
    add_config_args(parser)

    def run(cfg: RunConfig, args: argparse.Namespace) -> Sequence[StageOutcome | None]:
        if args.stage == "all":
            return _run_all(cfg, args.force)
        return [get_stage(args.stage).run(cfg, force=args.force)]

    stage_main(parser, argv, run, write_config=True,
               lock_owner=lambda args: CLI if args.stage == "all" else f"{CLI} {args.stage}")


if __name__ == "__main__":
    main()
