"""The evaluate stage: real speculative decoding of the exported drafter against plain greedy decoding.

    python -m eagle3.evaluate.stage --config runs/smollm2-demo/config.json
    python -m eagle3.evaluate.stage --preset smollm2-demo --set evaluate.methods=[chain,tree,ngram] --export-dir DIR

The drafter is loaded back from <run>/export/sglang (so the export is what gets tested) and the target
from the run's target. Per prompt, in one process: plain greedy decoding (the shared reference, timed),
then every method (timed) with the same prompt and max_new_tokens, each output checked token by token
against the reference (eagle3.evaluate.speculate.check_lossless). Every process warms up on the first prompt
before it measures anything. With num_workers > 1, prompts are spread over spawned processes sharing
the device; their wall times then include the contention (acceptance is unaffected).

Definitions (docs/evaluate.md): acceptance length = tokens committed by verify forwards / verify forwards
(bonus included; the prefill's first token is in neither); per-position acceptance at draft position i =
verify steps that accepted >= i tokens / steps that proposed position i, and conditional = the same over
steps that accepted >= i-1; speedup = greedy wall time / method wall time over the same prompts.

Outputs in <run>/eval/: results.json, report.md, per_position.png, prompts.jsonl (and rejects.jsonl for rejected
prompt-file lines); manifest last. While it runs, every measured prompt is journaled (evaluate.journal.jsonl), so a
killed evaluation re-measures only the rest. A greedy evaluation of the run's own export also writes the measured
table into its model cards (eagle3.export.model_card); named with --export-dir (e.g. carried to a host without the
run's data), only the table of its card is rewritten. At temperature > 0 (speculative sampling) the cards are left.

Modules: eagle3.evaluate.session (the methods, one process's loaded models, one prompt measured),
eagle3.evaluate.pool (many prompts, spawned workers, the journal), eagle3.evaluate.records (the typed records
and their JSON), eagle3.evaluate.report (summary rows, report.md, plot, output files); this one: the stage and CLI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from eagle3.config import ConfigError, RunConfig, section_dict
from eagle3.evaluate.pool import evaluate_prompts, journaled_records
from eagle3.evaluate.prompts import EvalPrompt, rejects_by_dataset
from eagle3.evaluate.records import EvalSettings, PartialInfo, PromptRecord, SummaryRow
from eagle3.evaluate.report import summarize_all, summarize_categories, write_outputs
from eagle3.evaluate.session import EvalJob, dflash_block_size, method_specs
from eagle3.export import stage as export
from eagle3.run.journal import Journal
from eagle3.run.layout import EVAL_DIR, run_layout, run_relative
from eagle3.run.progress import ProgressFn
from eagle3.run.stage import StageId, StageOutcome, run_stage, stage_key

STAGE = StageId("evaluate", EVAL_DIR)
SECTION = "evaluate"
DESCRIPTION = "measure acceptance length by speculative decoding"
COMMAND = "eval"
"""``eagle3 eval`` runs this stage too (as ``eagle3 stage evaluate`` does)."""

JOURNAL_NAME = "evaluate.journal.jsonl"
"""<run>/eval/: one fsynced line per measured prompt while the stage runs; removed once the outputs exist."""


# ------------------------------------------------------------------------------------------------- stage


def eval_dir(cfg: RunConfig) -> Path:
    """<run>/eval."""
    return run_layout(cfg).eval


def manifest_path(cfg: RunConfig) -> Path:
    """<run>/eval/evaluate.manifest.json."""
    return STAGE.manifest(cfg.run_dir)


def default_export_dir(cfg: RunConfig) -> Path:
    """<run>/export/sglang: the SGLang layout the export stage writes."""
    return run_layout(cfg).sglang_export


def stage_key_of(cfg: RunConfig) -> str:
    """The key of evaluating the run's own export (prepares the target to fingerprint it)."""
    from eagle3.target.load import prepare_target

    return key_for(cfg, prepare_target(cfg))


def key_for(cfg: RunConfig, model_dir: Path, export_dir: Path | None = None) -> str:
    """Evaluate section + target fingerprint + the export manifest (or, for an explicit folder, its files' hashes) +
    the content of every prompt file among evaluate.datasets."""
    from eagle3.evaluate.prompts import prompt_file_hashes
    from eagle3.target.load import fingerprint
    from infra.storage import sha256_file

    extra: dict[str, Any] = {"target": fingerprint(model_dir)}
    prompt_files = prompt_file_hashes(cfg.evaluate.datasets)
    if prompt_files:  # (left out without one: the keys of evaluations of the named sets stay as they were)
        extra["prompt_files"] = prompt_files
    inputs = [export.STAGE.manifest(cfg.run_dir)]
    if export_dir is not None:
        from eagle3.export.model_card import CARD_FILE  # rewritten by this stage: never part of what it measured

        files = sorted(p for p in Path(export_dir).iterdir() if p.is_file() and p.name != CARD_FILE)
        extra[export.STAGE.name] = {p.name: sha256_file(p) for p in files}
        inputs = []
    return stage_key(STAGE, section_dict(cfg, SECTION), inputs, extra)


def resolve_device(device: str) -> str:
    """'auto' -> cuda when a GPU is visible, else cpu (the capture backend's rule); cuda without one is an error."""
    import torch

    from eagle3.features.hf_models import resolve_device as resolve_auto

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("evaluate.device is cuda but no CUDA device is visible")
    return resolve_auto(device)


def _settings(
    cfg: RunConfig,
    model_dir: Path,
    export_dir: Path,
    device: str,
    items: Sequence[tuple[EvalPrompt, list[int]]],
    stop_ids: list[int],
) -> EvalSettings:
    import torch
    import transformers

    from eagle3.export.checks import read_json
    from eagle3.target.load import fingerprint

    e = cfg.evaluate.resolved(device)
    counts: dict[str, int] = {d: sum(p.dataset == d for p, _ in items) for d in e.datasets}
    export_cfg = read_json(export_dir / "config.json")
    return EvalSettings(
        evaluate=e.model_dump(mode="json"),
        target=cfg.target.name,
        target_dir=str(model_dir),
        target_fingerprint=fingerprint(model_dir),
        export_dir=run_relative(cfg.run_dir, export_dir),  # relocatable
        aux_layer_ids=export_cfg.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
        or export_cfg.get("dflash_config", {}).get("target_layer_ids"),
        device=device,
        gpu=torch.cuda.get_device_name() if device == "cuda" else None,
        dtype=e.dtype,
        max_new_tokens=e.max_new_tokens,
        num_prompts=counts,
        stop_ids=stop_ids,
        ngram=f"n-gram {e.ngram_max} down to {e.ngram_min}, up to {e.ngram_num_tokens} tokens, whole context",
        methods=method_specs(e, dflash_block_size(export_dir)),
        num_workers=e.num_workers,
        torch=torch.__version__,
        transformers=transformers.__version__,
    )


@dataclass
class _Plan:
    """What one evaluation measures: the rendered prompts and the workers' job (device, stop ids, settings)."""

    items: list[tuple[EvalPrompt, list[int]]]
    job: EvalJob
    rejects: list[Any]  # eagle3.data.rejects.Reject: the prompt-file lines left out


def _plan(cfg: RunConfig, model_dir: Path, export_dir: Path) -> _Plan:
    from eagle3.evaluate.prompts import load_prompt_set
    from eagle3.target.load import load_tokenizer, stop_token_ids, target_info

    device = resolve_device(cfg.evaluate.device)
    e = cfg.evaluate.resolved(device)
    tokenizer = load_tokenizer(model_dir)
    stop_ids = stop_token_ids(tokenizer, target_info(model_dir, cfg.target))
    prompt_set = load_prompt_set(e.datasets, {name: e.limit_for(name) for name in e.datasets}, tokenizer)
    items = prompt_set.items
    threads = max(1, (os.cpu_count() or 1) // e.num_workers) if e.num_workers > 1 else None  # split the cores
    cache_len = max((len(ids) for _, ids in items), default=0) + e.max_new_tokens + 128  # + verify and draft rows
    job = EvalJob(str(model_dir), str(export_dir), e.model_dump(mode="json"), device, stop_ids, threads, cache_len)
    return _Plan(items, job, prompt_set.rejects)


def journal_of(cfg: RunConfig) -> Journal:
    """<run>/eval/evaluate.journal.jsonl."""
    return Journal(eval_dir(cfg) / JOURNAL_NAME)


def _report(
    cfg: RunConfig,
    model_dir: Path,
    export_dir: Path,
    plan: _Plan,
    records: list[PromptRecord],
    out_dir: Path,
    partial: PartialInfo | None = None,
) -> tuple[dict[str, Path], list[SummaryRow]]:
    """Summarize the records and write results, report, plot and prompts into ``out_dir``; (outputs, rows)."""
    methods = [s.name for s in method_specs(cfg.evaluate, dflash_block_size(export_dir))]
    rows = summarize_all(records, methods)
    settings = _settings(cfg, model_dir, export_dir, plan.job.device, plan.items, plan.job.stop_ids)
    settings = replace(settings, prompt_rejects=rejects_by_dataset(plan.rejects))
    if partial:
        settings = replace(settings, partial=partial)
    fell_back = {name: why for r in records for name, why in r.decode_fallbacks.items()}
    if fell_back:
        settings = replace(settings, decode_fallbacks=fell_back)
    return write_outputs(out_dir, records, rows, settings, summarize_categories(records, methods), plan.rejects), rows


def _compute(
    cfg: RunConfig, model_dir: Path, export_dir: Path, progress: ProgressFn | None, show_bar: bool | None, key: str
) -> tuple[dict[str, Path], dict[str, Any]]:
    start = time.perf_counter()
    e, plan, journal = cfg.evaluate, _plan(cfg, model_dir, export_dir), journal_of(cfg)
    planned = time.perf_counter()
    records = evaluate_prompts(plan.job, plan.items, e.num_workers, progress, show_bar, journal=journal, key=key)
    measured = time.perf_counter()
    outputs, rows = _report(cfg, model_dir, export_dir, plan, records, eval_dir(cfg))
    # Where an evaluation's wall time went beyond the decodes (the 5-minute goal counts all of it).
    print(
        f"evaluate: prompts rendered in {planned - start:.1f} s, {len(records)} prompts measured in "
        f"{measured - planned:.1f} s (loading and warm-up included), outputs written in "
        f"{time.perf_counter() - measured:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    journal.path.unlink(missing_ok=True)  # prompts.jsonl now holds every record; a forced re-run measures afresh
    stats = {
        f"{r.dataset}/{r.method}": {
            "accept_len": r.accept_len,
            "speedup": r.speedup,
            "tokens_per_s": r.tokens_per_s,
            "lossless_identical": r.lossless.identical,
            "num_prompts": r.num_prompts,
        }
        for r in rows
    }
    return outputs, stats


def write_partial_report(cfg: RunConfig, export_dir: Path | None = None) -> dict[str, Path]:
    """<run>/eval/partial/: the report of the prompts an unfinished evaluation has journaled (no manifest, marked
    PARTIAL), for a run cut short by a time limit; the stage itself still measures the rest when run again."""
    from eagle3.target.load import prepare_target

    model_dir = prepare_target(cfg)
    source = Path(export_dir) if export_dir is not None else default_export_dir(cfg)
    plan = _plan(cfg, model_dir, source)
    indexed = [(i, p, ids) for i, (p, ids) in enumerate(plan.items)]
    journal = journal_of(cfg)
    done = journaled_records(journal, key_for(cfg, model_dir, export_dir), indexed)
    if not done:
        raise FileNotFoundError(f"no prompt of these settings is journaled in {journal.path}")
    records = [done[i] for i in sorted(done)]
    partial = PartialInfo(
        len(records), len(plan.items), {d: sum(r.dataset == d for r in records) for d in cfg.evaluate.datasets}
    )
    return _report(cfg, model_dir, source, plan, records, eval_dir(cfg) / "partial", partial)[0]


def run_evaluate(
    cfg: RunConfig,
    progress: ProgressFn | None = None,
    force: bool = False,
    export_dir: Path | None = None,
    show_bar: bool | None = None,
    known_key: str | None = None,
) -> StageOutcome:
    """Evaluate <run>/export/sglang (or ``export_dir``) on the run's target; skipped when the manifest matches."""
    from eagle3.target.load import prepare_target

    model_dir = prepare_target(cfg)
    source = Path(export_dir) if export_dir is not None else default_export_dir(cfg)
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"no SGLang export at {source} (run the export stage first, or pass --export-dir)")
    key = known_key or key_for(cfg, model_dir, export_dir)
    if force:
        journal_of(cfg).path.unlink(missing_ok=True)
    outcome = run_stage(
        STAGE,
        manifest_path(cfg),
        key,
        force=force,
        compute=lambda: _compute(cfg, model_dir, source, progress, show_bar, key),
    )
    if cfg.evaluate.temperature > 0:  # the cards' table is the greedy, token-identical one: a sampled run leaves it
        return outcome
    results = json.loads(Path(outcome.outputs["results"]).read_text())
    if export_dir is None:  # the run's own export: its model cards get the table just measured (or still current)
        export.write_cards(cfg, results, model_dir)
    elif source.resolve() == default_export_dir(cfg).resolve():  # the same, named (e.g. carried without its data)
        from eagle3.export.model_card import write_measured

        write_measured(source, results)
    return outcome


def skip_reason(cfg: RunConfig) -> str | None:
    """None: evaluate always runs."""
    return None


def headline(result: Mapping[str, Any]) -> str:
    """The run summary's result cell (eagle3.run.summary): the measured acceptance length of each method."""
    accepted = acceptance_by_method(result.get("stats") or {})
    return ", ".join(f"{method} {accept:.3f}" for method, accept in accepted.items())


def acceptance_by_method(stats: Mapping[str, Any]) -> dict[str, float]:
    """{method: accept_len} of the manifest's stats ({"<dataset>/<method>": {"accept_len": ...}}): the 'all' rows
    when there are several datasets, else the one dataset's."""
    rows: list[tuple[str, str, Any]] = []  # (dataset, method, accept_len)
    for name, value in stats.items():
        dataset, slash, method = name.partition("/")
        if slash and isinstance(value, Mapping):
            rows.append((dataset, method, value.get("accept_len")))
    pooled = [row for row in rows if row[0] == "all"]
    return {method: float(accept) for _, method, accept in pooled or rows if isinstance(accept, (int, float))}


key = stage_key_of


def run(
    cfg: RunConfig, progress: ProgressFn | None = None, force: bool = False, known_key: str | None = None
) -> StageOutcome:
    """Evaluate the run's own export (<run>/export/sglang) in this process."""
    return run_evaluate(cfg, progress=progress, force=force, known_key=known_key)


def main(argv: list[str] | None = None) -> None:
    """python -m eagle3.evaluate.stage --preset X [--set a.b=c] | --config <run>/config.json [--export-dir D] [--force]
    [--partial-report]"""
    from eagle3.run.cli_args import add_config_args, print_json, stage_main

    parser = add_config_args(argparse.ArgumentParser(description=main.__doc__))
    parser.add_argument("--export-dir", type=Path, help="an SGLang export folder (default <run>/export/sglang)")
    parser.add_argument("--force", action="store_true", help="recompute even if the manifest matches")
    parser.add_argument(
        "--partial-report",
        action="store_true",
        help="only report the prompts an unfinished evaluation has journaled (<run>/eval/partial/)",
    )

    def run(cfg: RunConfig, args: argparse.Namespace) -> StageOutcome | Path:
        if args.partial_report:
            return write_partial_report(cfg, args.export_dir)["report"]
        return run_evaluate(cfg, force=args.force, export_dir=args.export_dir, show_bar=True)

    def show(result: StageOutcome | Path) -> None:
        if isinstance(result, Path):  # the partial report
            print(result.read_text())
            return
        print(Path(result.outputs["report"]).read_text())
        print_json(result)

    # the partial report reads the journal only: no lock, so it works while the evaluation runs
    stage_main(
        parser,
        argv,
        run,
        show=show,
        lock_owner=lambda args: None if args.partial_report else "python -m eagle3.evaluate.stage",
    )


if __name__ == "__main__":
    main()
