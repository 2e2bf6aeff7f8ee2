"""The export stage: the selected checkpoint in every configured layout, its key, model cards, and the CLI.

python -m eagle3.export --config runs/smollm2-demo/config.json
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3.config import RunConfig
from eagle3.data.stages import vocab
from eagle3.run.layout import EXPORT_DIR, manifest_name, resolve_in_run, run_relative
from eagle3.run.progress import ProgressFn
from eagle3.run.stage import StageId, StageOutcome
from eagle3.train import STAGE as TRAIN

if TYPE_CHECKING:  # the stage module loads without torch (eagle3.run.registry imports it); the work imports it
    from torch import Tensor

    from eagle3.drafter.model import DrafterDims

log = logging.getLogger("eagle3.export")

STAGE = StageId("export", EXPORT_DIR)
SECTION = "export"
DESCRIPTION = "export the trained drafter (SGLang, speculators)"
COMMAND = "export"
"""``eagle3 export`` runs this stage too (as ``eagle3 stage export`` does)."""
MANIFEST_FILE, TRAIN_MANIFEST = manifest_name(STAGE.name), Path(TRAIN.folder) / manifest_name(TRAIN.name)


DFLASH_SKIPS = {
    "speculators": "the speculators format has no DFlash drafter (SGLang's DFlashDraftModel layout is "
    "written to export/sglang)"
}
"""Formats a DFlash drafter is not written in, and why (recorded in the export manifest)."""


def check_export(export_dir: Path) -> str:
    """Check a folder of any layout (chosen by its architectures); returns the layout's name."""
    from eagle3.export.checks import CONFIG_FILE, read_json
    from eagle3.export.dflash import DFLASH_ARCHITECTURE, check_dflash_export
    from eagle3.export.sglang import check_sglang_export
    from eagle3.export.speculators import SPECULATORS_ARCHITECTURE, check_speculators_export

    architectures = read_json(Path(export_dir) / CONFIG_FILE).get("architectures")
    if architectures == [SPECULATORS_ARCHITECTURE]:
        check_speculators_export(export_dir)
        return "speculators"
    if architectures == [DFLASH_ARCHITECTURE]:
        check_dflash_export(export_dir)
        return "dflash"
    check_sglang_export(export_dir)
    return "sglang"


def export_dir(cfg: RunConfig) -> Path:
    """<run>/export."""
    return cfg.run_dir / EXPORT_DIR


def key_for(cfg: RunConfig) -> str:
    """The export stage key: export section and train.select, train + vocab manifests, target fingerprint."""
    from eagle3.config import section_dict
    from eagle3.run.stage import stage_key
    from eagle3.target.load import fingerprint, prepare_target

    fp = fingerprint(prepare_target(cfg))
    conf = section_dict(cfg, SECTION) | {"train.select": cfg.train.select}  # what to ship: not in train's key
    if cfg.drafter.family != "eagle3":  # another layout is written (eagle3 runs keep their keys)
        conf["drafter.family"] = cfg.drafter.family
    return stage_key(STAGE, conf, [TRAIN.manifest(cfg.run_dir), vocab.STAGE.manifest(cfg.run_dir)], {"target": fp})


def _train_stats(cfg: RunConfig) -> dict[str, Any]:
    from eagle3.run.stage import read_manifest

    return (read_manifest(cfg.run_dir / TRAIN_MANIFEST) or {}).get("stats", {})


def _checkpoint_dir(cfg: RunConfig) -> tuple[Path, Any]:
    """(checkpoint folder, eagle3.export.model_card.Selection): export.checkpoint, else train.select's; its weights
    checked against the sha256 its checkpoint.json recorded (CorruptCheckpointError naming the file)."""
    from eagle3.export.checks import WEIGHTS_FILE
    from eagle3.export.model_card import select_checkpoint
    from eagle3.train.checkpoint import MODEL_FILE, verify_checkpoint

    selection = select_checkpoint(cfg.train.select, cfg.export.checkpoint, _train_stats(cfg))
    path = cfg.run_dir / TRAIN.folder / selection.checkpoint
    if not selection.checkpoint or not (path / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"no checkpoint weights at {path / WEIGHTS_FILE} ({selection.reason})")
    verify_checkpoint(path, (MODEL_FILE,))
    return path, selection


def write_cards(cfg: RunConfig, results: dict[str, Any] | None = None, model_dir: Path | None = None) -> list[Path]:
    """README.md (eagle3.export.model_card) into every export folder of the run; ``results``: the evaluation of them."""
    from eagle3.export.checks import INFO_FILE, read_json
    from eagle3.export.model_card import CardInputs, write_card
    from eagle3.target.load import prepare_target

    model_dir, train = model_dir or prepare_target(cfg), _train_stats(cfg)
    folders = {f: export_dir(cfg) / f for f in cfg.export.formats if (export_dir(cfg) / f / INFO_FILE).is_file()}
    return [
        write_card(
            CardInputs(
                cfg, folder, fmt, folders.get("sglang"), model_dir, read_json(folder / INFO_FILE), train, results
            )
        )
        for fmt, folder in folders.items()
    ]


def _verifier(cfg: RunConfig, model_dir: Path) -> str:
    hf_path = cfg.target.path if cfg.target.kind == "hf" else None
    return cfg.export.verifier_name_or_path or hf_path or str(Path(model_dir).resolve())


def _drafter_inputs(cfg: RunConfig, model_dir: Path) -> tuple[DrafterDims, list[int], Tensor, Tensor]:
    """(dims, aux ids in our convention, d2t, t2d), checked against the features the drafter was trained on."""
    from eagle3.data.vocab import load_vocab_map
    from eagle3.features.spec import FeatureSpec
    from eagle3.target.load import fingerprint, target_info
    from eagle3.target.tensors import drafter_dims

    spec = FeatureSpec.load(cfg.run_dir / "features" / "spec.json")
    info = target_info(model_dir, cfg.target)
    if spec.target_fingerprint != fingerprint(model_dir) or spec.aux_layer_ids != info.aux_layer_ids:
        raise ValueError(
            f"features/spec.json (target {spec.target_fingerprint}, aux {spec.aux_layer_ids}) does not "
            f"match the configured target {model_dir} (aux {info.aux_layer_ids})"
        )
    d2t, t2d = load_vocab_map(cfg.run_dir / vocab.STAGE.folder)
    return drafter_dims(info, model_dir, draft_vocab_size=len(d2t)), list(spec.aux_layer_ids), d2t, t2d


def _export_all(cfg: RunConfig) -> tuple[dict[str, Path], dict[str, Any]]:
    from safetensors.torch import load_file

    from eagle3.export.checks import (
        CONFIG_FILE,
        FLOAT_DTYPES,
        WEIGHTS_FILE,
        aux_id_warnings,
        sglang_aux_ids,
        speculators_aux_ids,
    )
    from eagle3.export.sglang import export_sglang
    from eagle3.export.speculators import export_speculators
    from eagle3.target.load import EMBED_TENSOR, prepare_target, read_tensor

    model_dir = prepare_target(cfg)
    dims, aux, d2t, t2d = _drafter_inputs(cfg, model_dir)
    ckpt, selection = _checkpoint_dir(cfg)
    weights, dtype = load_file(str(ckpt / WEIGHTS_FILE)), FLOAT_DTYPES[cfg.export.dtype]
    # Paths inside the run are recorded relative to the run dir, so a moved or copied run stays valid.
    common = dict(
        run_config=cfg.model_dump(mode="json"), source=run_relative(cfg.run_dir, ckpt), selection=selection.to_json()
    )
    outputs: dict[str, Path] = {}
    stats: dict[str, Any] = {
        "checkpoint": str(ckpt.relative_to(cfg.run_dir)),
        "selection": selection.to_json(),
        "dtype": cfg.export.dtype,
        "formats": {},
    }
    if cfg.drafter.family == "dflash":
        return _export_dflash(cfg, model_dir, weights, dtype, common, stats)
    embed = {"embed_tokens.weight": read_tensor(model_dir, EMBED_TENSOR)}  # [V, H], for the speculators layout
    for fmt in dict.fromkeys(cfg.export.formats):
        out = export_dir(cfg) / fmt
        if fmt == "sglang":
            export_sglang(weights, dims, d2t, t2d, aux, out, dtype, **common)
            ids = sglang_aux_ids(aux)
        else:
            export_speculators(
                weights | embed,
                dims,
                d2t,
                t2d,
                aux,
                out,
                dtype,
                _verifier(cfg, model_dir),
                speculative_tokens=cfg.export.speculative_tokens,
                **common,
            )
            ids = speculators_aux_ids(aux)
        outputs |= {f"{fmt}_config": out / CONFIG_FILE, f"{fmt}_weights": out / WEIGHTS_FILE}
        stats["formats"][fmt] = {
            "dir": run_relative(cfg.run_dir, out),
            "aux_layer_ids": ids,
            "warnings": aux_id_warnings(aux) if fmt == "sglang" else [],
        }
    stats["aux_layer_ids_output_of_layer"] = aux
    write_cards(cfg, model_dir=model_dir)  # no measured table: the evaluate stage adds it (not hashed: module doc)
    return outputs, stats


def _export_dflash(
    cfg: RunConfig,
    model_dir: Path,
    weights: dict[str, Tensor],
    dtype: Any,
    common: dict[str, Any],
    stats: dict[str, Any],
) -> tuple[dict[str, Path], dict[str, Any]]:
    """drafter.family=dflash: SGLang's DFlashDraftModel layout in export/sglang (eagle3.export.dflash, checked there:
    names, shapes, dtypes, finite values); the formats without a DFlash layout are recorded as skipped."""
    from eagle3.export.checks import CONFIG_FILE, WEIGHTS_FILE
    from eagle3.export.dflash import export_dflash
    from eagle3.features.spec import FeatureSpec
    from eagle3.train.dflash import dflash_setup

    formats = list(dict.fromkeys(cfg.export.formats))
    if "sglang" not in formats:
        raise ValueError(f"export.formats {formats} holds no layout of a DFlash drafter: add sglang")
    setup = dflash_setup(cfg, model_dir, FeatureSpec.load(cfg.run_dir / "features" / "spec.json").aux_layer_ids)
    out = export_dir(cfg) / "sglang"
    export_dflash(weights, setup.dims, setup.target_layer_ids, setup.num_target_layers, out, dtype, **common)
    stats["formats"]["sglang"] = {
        "dir": run_relative(cfg.run_dir, out),
        "aux_layer_ids": setup.target_layer_ids,
        "warnings": [],
    }
    for fmt in formats:
        if fmt != "sglang":
            log.warning("export: %s not written: %s", fmt, DFLASH_SKIPS[fmt])
            stats["formats"][fmt] = {"skipped": DFLASH_SKIPS[fmt]}
    stats["aux_layer_ids_output_of_layer"] = setup.target_layer_ids
    write_cards(cfg, model_dir=model_dir)  # no measured table: the evaluate stage adds it
    return {"sglang_config": out / CONFIG_FILE, "sglang_weights": out / WEIGHTS_FILE}, stats


def run_export(cfg: RunConfig, force: bool = False, known_key: str | None = None) -> StageOutcome:
    """Export the selected checkpoint in every configured layout; a no-op when the manifest matches."""
    from eagle3.run.stage import run_stage

    return run_stage(
        STAGE, export_dir(cfg) / MANIFEST_FILE, known_key or key_for(cfg), lambda: _export_all(cfg), force=force
    )


# ------------------------------------------------------------------------------- the stage (eagle3.run.registry)


def skip_reason(cfg: RunConfig) -> str | None:
    """None: export always runs."""
    return None


key = key_for


def run(
    cfg: RunConfig, progress: ProgressFn | None = None, force: bool = False, known_key: str | None = None
) -> StageOutcome:
    """The export stage in this process (``progress`` unused: an export takes seconds)."""
    return run_export(cfg, force, known_key)


def main(argv: list[str] | None = None) -> None:
    """python -m eagle3.export --config <run>/config.json [--set export.dtype=float32] [--force] | --check DIR"""
    from eagle3.run.cli_args import add_config_args, stage_main

    parser = add_config_args(argparse.ArgumentParser(description=main.__doc__))
    parser.add_argument("--force", action="store_true", help="export again even if the manifest matches")
    parser.add_argument("--check", type=Path, metavar="DIR", help="only check an existing export folder")

    def check_only(args: argparse.Namespace) -> bool:
        if args.check:
            print(f"{args.check}: {check_export(args.check)} layout, check passed")
        return bool(args.check)

    stage_main(
        parser,
        argv,
        lambda cfg, args: run_export(cfg, force=args.force),
        lock_owner="python -m eagle3.export",
        show=_show_export,
        without_config=check_only,
    )


def _show_export(outcome: StageOutcome) -> None:
    """What the export wrote, each folder checked again (files may have changed since)."""
    print(f"export {'written' if outcome.computed else 'up to date'} (checkpoint {outcome.stats['checkpoint']})")
    run_dir = Path(outcome.manifest).parent.parent  # <run>/export/export.manifest.json
    for fmt, entry in outcome.stats["formats"].items():
        if "skipped" in entry:
            print(f"  {fmt:<12} skipped: {entry['skipped']}")
            continue
        folder = resolve_in_run(run_dir, entry["dir"])  # relative; absolute in manifests of older runs
        print(
            f"  {check_export(folder):<12} {folder}  aux ids {entry['aux_layer_ids']}  "
            f"check passed" + "".join(f"\n  warning: {w}" for w in entry["warnings"])
        )


if __name__ == "__main__":
    main()
