"""What the data stages share: the target they run, the sources they read, and their command line."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from eagle3.config import RunConfig, SourceConfig


def target(cfg: RunConfig) -> tuple[Path, str]:
    """(the target's folder, prepared once into the cache; its fingerprint)."""
    from eagle3.target.load import fingerprint, prepare_target

    model_dir = prepare_target(cfg)
    return model_dir, fingerprint(model_dir)


def model_loader(cfg: RunConfig, model_dir: Path):
    """A function that loads the target and its tokenizer for in-process generation (regenerate.device)."""

    def load():
        from eagle3.features.hf_models import resolve_device
        from eagle3.target.load import load_model, load_tokenizer

        device = resolve_device(cfg.regenerate.device)
        return load_model(model_dir, cfg.target.dtype, device), load_tokenizer(model_dir)

    return load


def synthetic_sources(cfg: RunConfig) -> list[SourceConfig]:
    """The data sources the target writes itself (format synthetic), in config order."""
    return [src for src in cfg.data.sources if src.format == "synthetic"]


def kept_answer_sources(cfg: RunConfig) -> frozenset[str]:
    """Sources whose rows regeneration copies as they are: synthetic ones (the target wrote their answers) and
    those with keep_answers."""
    return frozenset(src.name for src in cfg.data.sources if src.format == "synthetic" or src.keep_answers)


def data_stage_main(module: str, argv: list[str] | None) -> None:
    """``python -m <module> --preset NAME [--set k=v ...] [--force]``: run the data stage of ``module`` under the
    run lock, after saving config.json; prints its outcome as JSON."""
    from eagle3.run.cli_args import add_config_args, stage_main

    stage = importlib.import_module(module)
    parser = argparse.ArgumentParser(description=f"the {stage.STAGE.name} stage: {stage.DESCRIPTION}")
    parser.add_argument("--force", action="store_true", help="recompute even if the manifest matches")
    add_config_args(parser)
    stage_main(
        parser,
        argv,
        lambda cfg, args: [stage.run(cfg, force=args.force)],
        write_config=True,
        lock_owner=f"python -m {module}",
    )
