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
import json
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3.config import RunConfig, SourceConfig, save_config, section_dict
from eagle3.run.progress import ProgressFn
from eagle3.run.stage import StageOutcome, run_stage, stage_key

if TYPE_CHECKING:
    from eagle3.data.regenerate_slices import SliceRunner

STAGES = ("synthesize", "merge", "regenerate", "tokenize", "vocab")
OPERATIONAL_KNOBS = {"regenerate": ("num_slices",)}
"""Fields that change how a stage runs, not what it writes: left out of its key, so changing them redoes nothing."""


def data_dir(cfg: RunConfig) -> Path:
    """<run>/data."""
    return cfg.run_dir / "data"


def manifest_path(cfg: RunConfig, stage: str) -> Path:
    """Where a stage's manifest lives."""
    return (cfg.run_dir / "vocab" if stage == "vocab" else data_dir(cfg)) / f"{stage}.manifest.json"


def write_run_config(cfg: RunConfig) -> Path:
    """Save the resolved config as <run>/config.json."""
    return save_config(cfg, cfg.run_dir / "config.json")


def key_for(cfg: RunConfig, stage: str, fp: str | None = None) -> str:
    """The stage key (eagle3.run.stage); Prefect's cache key for the stage's task is this same string.

    ``fp`` is the target fingerprint when the caller has it already (else it is computed here).
    """
    if stage == "merge":
        conf = {"data": cfg.data.model_dump(mode="json"), "seed": cfg.run.seed}
        upstream = [manifest_path(cfg, "synthesize")] if synthetic_sources(cfg) else []
        return stage_key("merge", conf, upstream, extra={"source_files": _source_stamps(cfg)})
    fp = fp or _target(cfg)[1]
    if stage == "synthesize":
        from eagle3.data.synthesize import stage_config

        conf = stage_config(synthetic_sources(cfg), cfg.regenerate)
        return stage_key(stage, conf, [], {"target": _generating(cfg, fp)})
    upstream = {"regenerate": manifest_path(cfg, "merge"), "tokenize": _conversations_manifest(cfg),
                "vocab": manifest_path(cfg, "tokenize")}[stage]
    conf = section_dict(cfg, stage)
    conf[stage] = {k: v for k, v in conf[stage].items() if k not in OPERATIONAL_KNOBS.get(stage, ())}
    return stage_key(stage, conf, [upstream], {"target": fp})


def _generating(cfg: RunConfig, fp: str) -> str:
    """The generating target: its fingerprint and the dtype it is loaded in (the dtype changes the text too)."""
    return f"{fp}:{cfg.target.dtype}"


def is_complete(cfg: RunConfig, stage: str) -> bool:
    """True when the stage's manifest matches its current inputs (a re-run would skip it)."""
    from eagle3.run.stage import manifest_matches

    path = manifest_path(cfg, stage)
    return path.is_file() and manifest_matches(path, key_for(cfg, stage))


def synthetic_sources(cfg: RunConfig) -> list[SourceConfig]:
    """The data sources the target writes itself (format synthetic), in config order."""
    return [src for src in cfg.data.sources if src.format == "synthetic"]


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
        raise ValueError("data.sources is empty: nothing to merge (add a source in the preset or with --set)")
    return run_stage("merge", manifest_path(cfg, "merge"), key_for(cfg, "merge"), force=force,
                     compute=lambda: merge_sources(cfg.data.sources, cfg.data, cfg.run.seed, data_dir(cfg), progress))


def _source_stamps(cfg: RunConfig) -> list[dict]:
    """Name, size and mtime of each source file: a changed file changes the merge key."""
    from eagle3.run.paths import resolve_path

    stamps = []
    for src in cfg.data.sources:
        if src.path is None:
            continue  # a synthetic source: the synthesize manifest is the merge's input
        path = resolve_path(src.path)
        stat = path.stat() if path.is_file() else None
        stamps.append({"name": src.name, "path": str(path), "bytes": stat.st_size if stat else None,
                       "mtime_ns": stat.st_mtime_ns if stat else None})
    return stamps


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
    own = frozenset(src.name for src in synthetic_sources(cfg))  # answered by the target already
    in_parquet = data_dir(cfg) / "merged.parquet"

    def compute():
        if run_slices is not None and cfg.regenerate.num_slices > 1:
            return regenerate_sliced(in_parquet, data_dir(cfg), cfg.regenerate, run_slices, progress, keep_sources=own)
        return regenerate(in_parquet, data_dir(cfg), cfg.regenerate, _chat_backend(cfg, model_dir), progress,
                          keep_sources=own)

    return run_stage("regenerate", manifest_path(cfg, "regenerate"), key, compute, force=force)


def run_regenerate_slice(cfg: RunConfig, index: int, progress: ProgressFn | None = None) -> dict:
    """Answer slice ``index`` of a sliced regeneration planned by ``run_regenerate`` (its stats)."""
    from eagle3.data.regenerate_slices import regenerate_slice

    model_dir, _ = _target(cfg)
    return regenerate_slice(data_dir(cfg) / "merged.parquet", data_dir(cfg), cfg.regenerate,
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
    in_parquet = data_dir(cfg) / ("regenerated.parquet" if cfg.regenerate.enabled else "merged.parquet")
    return run_stage("tokenize", manifest_path(cfg, "tokenize"), key, force=force, compute=lambda: tokenize_dataset(
        in_parquet, data_dir(cfg), load_tokenizer(model_dir), cfg.tokenize, progress))


def run_vocab(cfg: RunConfig, progress: ProgressFn | None = None, force: bool = False) -> StageOutcome:
    """Build the draft vocab map from train-split assistant tokens."""
    from eagle3.target.load import load_tokenizer, stop_token_ids, target_info
    from eagle3.data.vocab import build_vocab_map

    model_dir, fp = _target(cfg)
    key = key_for(cfg, "vocab", fp)

    def compute():
        info = target_info(model_dir, cfg.target)
        forced = stop_token_ids(load_tokenizer(model_dir), info)
        return build_vocab_map(data_dir(cfg) / "tokenized.parquet", info.vocab_size, cfg.vocab.draft_vocab_size,
                               forced, cfg.run_dir / "vocab", fp)

    return run_stage("vocab", manifest_path(cfg, "vocab"), key, compute, force=force)


def run_all(cfg: RunConfig, force: bool = False) -> list[StageOutcome]:
    """Every data stage in order (what the pipeline flow does, without Prefect)."""
    from infra.storage import run_lock

    with run_lock(cfg.run_dir, owner="python -m eagle3.run.stages"):
        write_run_config(cfg)
        outcomes = [run_synthesize(cfg, force=force), run_merge(cfg, force=force), run_regenerate(cfg, force=force),
                    run_tokenize(cfg, force=force), run_vocab(cfg, force=force)]
    return [o for o in outcomes if o is not None]


def main(argv: list[str] | None = None) -> None:
    """python -m eagle3.run.stages {synthesize,merge,regenerate,tokenize,vocab,all} --preset NAME [--set k=v ...]"""
    from eagle3.run.cli_args import add_config_args, config_from_args, exit_on_user_error
    from infra.storage import run_lock

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("stage", choices=(*STAGES, "all"))
    parser.add_argument("--force", action="store_true", help="recompute even if the manifest matches")
    add_config_args(parser)

    @exit_on_user_error
    def run() -> None:
        args = parser.parse_args(argv)
        cfg = config_from_args(args)
        if args.stage == "all":
            outcomes = run_all(cfg, force=args.force)
        else:
            with run_lock(cfg.run_dir, owner=f"python -m eagle3.run.stages {args.stage}"):
                write_run_config(cfg)
                outcomes = [globals()[f"run_{args.stage}"](cfg, force=args.force)]
        for outcome in outcomes:
            if outcome is not None:
                print(json.dumps(outcome.to_json(), indent=2))

    run()


if __name__ == "__main__":
    main()
