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

Outputs in <run>/eval/: results.json, report.md, per_position.png, prompts.jsonl; manifest last. While it runs,
every measured prompt is journaled (evaluate.journal.jsonl), so a killed evaluation re-measures only the rest.
Evaluating the run's own export also writes the measured table into its model cards (eagle3.model_card).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3.config import EvaluateConfig, RunConfig, section_dict
from eagle3.evaluate.prompts import EvalPrompt
from eagle3.evaluate.report import summarize_all, write_outputs
from eagle3.run.journal import Journal
from eagle3.run.layout import run_layout
from eagle3.run.progress import Progress, ProgressFn
from eagle3.run.stage import StageOutcome, run_stage, stage_key

JOURNAL_NAME = "evaluate.journal.jsonl"
"""<run>/eval/: one fsynced line per measured prompt while the stage runs; removed once the outputs exist."""

WARMUP_TOKENS = 8
"""Tokens each method generates on the first prompt before anything is timed (kernels, allocator, caches)."""


# ------------------------------------------------------------------------------------------------- methods

@dataclass(frozen=True)
class MethodSpec:
    """One drafting method; names follow SGLang's steps-topk-num_draft_tokens (chain-3-1-4, tree-5-4-8)."""

    name: str
    kind: str  # chain | tree | ngram
    steps: int = 0
    topk: int = 1
    num_draft_tokens: int = 0


def method_specs(ecfg: EvaluateConfig) -> list[MethodSpec]:
    """The methods the config asks for, in a fixed order: chains (by steps), tree, n-gram."""
    specs = []
    if "chain" in ecfg.methods:
        specs += [MethodSpec(f"chain-{s}-1-{s + 1}", "chain", s, 1, s + 1) for s in sorted(set(ecfg.chain_steps))]
    if "tree" in ecfg.methods:
        s, k, n = ecfg.tree_steps, ecfg.tree_topk, ecfg.tree_num_draft_tokens
        specs.append(MethodSpec(f"tree-{s}-{k}-{n}", "tree", s, k, n))
    if "ngram" in ecfg.methods:
        specs.append(MethodSpec("ngram", "ngram", ecfg.ngram_num_tokens, 1, ecfg.ngram_num_tokens + 1))
    return specs


def make_proposer(spec: MethodSpec, ecfg: EvaluateConfig, drafter: Any = None, d2t: Any = None,
                  runner: Any = None) -> Any:
    """The Proposer of a method (EAGLE methods need the drafter and its d2t; ``runner``: a shared drafter runner)."""
    from eagle3.evaluate.speculate import EagleProposer, NgramProposer

    if spec.kind == "ngram":
        return NgramProposer(ecfg.ngram_max, ecfg.ngram_min, ecfg.ngram_num_tokens)
    if drafter is None:
        raise ValueError(f"method {spec.name} needs a drafter")
    return EagleProposer(drafter, d2t, spec.steps, spec.topk, spec.num_draft_tokens, runner=runner)


# ------------------------------------------------------------------------------------------ one process

@dataclass(frozen=True)
class EvalJob:
    """What a (possibly spawned) process needs to rebuild the models: paths and settings, no tensors."""

    model_dir: str
    export_dir: str
    evaluate: dict[str, Any]  # EvaluateConfig as JSON
    device: str  # resolved: cpu | cuda
    stop_ids: list[int]
    num_threads: int | None = None  # torch CPU threads in a spawned process
    cache_len: int = 1024  # static KV cache entries: the longest prompt + max_new_tokens + a margin


@dataclass
class EvalSession:
    """Loaded target runner, proposers and settings of one process."""

    target: Any  # TargetRunner
    proposers: dict[str, Any]
    drafter: Any  # DrafterRunner of its own, for the teacher-forced cross-check
    ecfg: EvaluateConfig
    stop_ids: list[int]


def open_session(job: EvalJob) -> EvalSession:
    """Load the target and the exported drafter on the job's device; one drafter runner serves every method."""
    import torch

    from eagle3.evaluate.decode_cache import make_runners, resolve_decode
    from eagle3.export import load_sglang_export
    from eagle3.target.load import load_model

    ecfg = EvaluateConfig.model_validate(job.evaluate)
    loaded = load_sglang_export(Path(job.export_dir), Path(job.model_dir), job.device, getattr(torch, ecfg.dtype))
    model = load_model(Path(job.model_dir), ecfg.dtype, job.device)
    static, settings = resolve_decode(ecfg.static_cache, ecfg.compile, job.device)
    target, runner = make_runners(model, loaded.aux_layer_ids, loaded.drafter, loaded.d2t, static, settings,
                                  job.cache_len)
    proposers = {s.name: make_proposer(s, ecfg, loaded.drafter, loaded.d2t, runner) for s in method_specs(ecfg)}
    return EvalSession(target, proposers, runner, ecfg, list(job.stop_ids))


def warm_up(session: EvalSession, prompt_ids: list[int]) -> None:
    """Run every forward width of the static runners (compiles them), then greedy and every method briefly; untimed."""
    from eagle3.evaluate.speculate import greedy_decode, speculative_decode

    for runner in (session.target, session.drafter):
        getattr(runner, "warm_up_widths", lambda: None)()
    num = min(WARMUP_TOKENS, session.ecfg.max_new_tokens)
    greedy_decode(session.target, prompt_ids, num, session.stop_ids)
    for proposer in session.proposers.values():
        speculative_decode(session.target, proposer, prompt_ids, num, session.stop_ids)


def evaluate_prompt(session: EvalSession, index: int, prompt: EvalPrompt, ids: list[int]) -> dict[str, Any]:
    """The greedy reference and every method on one prompt: tokens, steps, wall times, lossless checks."""
    import torch

    from eagle3.evaluate.speculate import (check_lossless, draft_hits, greedy_decode, speculative_decode,
                                  teacher_forced_drafts)

    ecfg = session.ecfg
    ref = greedy_decode(session.target, ids, ecfg.max_new_tokens, session.stop_ids)
    drafts = teacher_forced_drafts(session.target, session.drafter, ids, ref.tokens)  # untimed
    record: dict[str, Any] = {"index": index, "dataset": prompt.dataset, "id": prompt.id, "prompt_tokens": len(ids),
                              "greedy": {"num_tokens": len(ref.tokens), "wall_s": ref.wall_s, "tokens": ref.tokens},
                              "teacher_forced": {"num_tokens": len(drafts), "num_hits": draft_hits(drafts, ref.tokens)},
                              "methods": {}}
    for name, proposer in session.proposers.items():
        out = speculative_decode(session.target, proposer, ids, ecfg.max_new_tokens, session.stop_ids)
        check = check_lossless(ref, out.tokens, ecfg.near_tie_logit_gap, getattr(torch, ecfg.dtype))
        record["methods"][name] = {
            "num_tokens": len(out.tokens), "wall_s": out.wall_s, "lossless": check.to_json(),
            "depth": [s.draft_depth for s in out.steps], "accepted": [s.accepted for s in out.steps],
            "committed": [s.committed for s in out.steps],
            **({"tokens": out.tokens} if check.kind != "identical" else {}),
        }
    return record


_SESSION: EvalSession | None = None  # the spawned process's session (set by _init_worker)


def _init_worker(job: EvalJob, warmup_ids: list[int]) -> None:
    global _SESSION
    import torch

    if job.num_threads:
        torch.set_num_threads(job.num_threads)
    _SESSION = open_session(job)
    warm_up(_SESSION, warmup_ids)


def _run_item(item: tuple[int, EvalPrompt, list[int]]) -> dict[str, Any]:
    return evaluate_prompt(_SESSION, *item)


def evaluate_prompts(job: EvalJob, items: Sequence[tuple[EvalPrompt, list[int]]], num_workers: int = 1,
                     progress: ProgressFn | None = None, show_bar: bool | None = None,
                     journal: Journal | None = None, key: str = "") -> list[dict[str, Any]]:
    """Per-prompt records in prompt order; num_workers > 1 spreads prompts over spawned processes.

    With a journal, every finished prompt is appended at once and prompts already journaled under the
    same key are not measured again, so a killed evaluation resumes where it stopped.
    """
    indexed = [(i, p, ids) for i, (p, ids) in enumerate(items)]
    done = journaled_records(journal, key, indexed)
    todo = interleaved([item for item in indexed if item[0] not in done])
    records = list(done.values())
    with Progress(len(indexed), "evaluate", progress, bar=show_bar) as bar, _appender(journal) as append:
        bar.update(len(done), resumed=len(done))
        for record in _measure(job, todo, indexed[0][2], num_workers):
            append({"id": str(record["index"]), "key": key, "record": record})
            records.append(record)
            bar.update(1)
    return sorted(records, key=lambda r: r["index"])


def interleaved(items: Sequence[tuple[int, EvalPrompt, list[int]]]) -> list[tuple[int, EvalPrompt, list[int]]]:
    """Measuring order: the first prompt of every dataset, then the second of each, ...; a run cut short (and
    its partial report) then covers every dataset. Records keep their index, so outputs stay in prompt order."""
    ranks: dict[str, int] = {}
    keyed = []
    for item in items:
        rank = ranks.get(item[1].dataset, 0)
        ranks[item[1].dataset] = rank + 1
        keyed.append((rank, item[0], item))
    return [item for _, _, item in sorted(keyed, key=lambda k: k[:2])]


def journaled_records(journal: Journal | None, key: str,
                      indexed: Sequence[tuple[int, EvalPrompt, list[int]]]) -> dict[int, dict[str, Any]]:
    """Records journaled under this key for these very prompts (same index, dataset, id and length)."""
    if journal is None:
        return {}
    entries = journal.load()
    done = {}
    for index, prompt, ids in indexed:
        entry = entries.get(str(index))
        record = entry.get("record") if entry and entry.get("key") == key else None
        same_prompt = record and (record["dataset"], record["id"], record["prompt_tokens"]) == (prompt.dataset,
                                                                                               prompt.id, len(ids))
        if same_prompt:
            done[index] = record
    return done


@contextlib.contextmanager
def _appender(journal: Journal | None) -> Iterator[Callable[[dict[str, Any]], None]]:
    if journal is None:
        yield lambda entry: None
        return
    with journal.appender() as append:
        yield append


def _measure(job: EvalJob, todo: list[tuple[int, EvalPrompt, list[int]]], warmup_ids: list[int],
             num_workers: int) -> Iterator[dict[str, Any]]:
    """Records of the prompts in ``todo`` as they finish (in this process, or a pool of spawned ones)."""
    if not todo:
        return
    if num_workers <= 1:
        session = open_session(job)
        warm_up(session, warmup_ids)
        for item in todo:
            yield evaluate_prompt(session, *item)
        return
    import multiprocessing

    pool = multiprocessing.get_context("spawn").Pool(min(num_workers, len(todo)), _init_worker, (job, warmup_ids))
    with pool:
        yield from pool.imap_unordered(_run_item, todo)


# ------------------------------------------------------------------------------------------------- stage

def eval_dir(cfg: RunConfig) -> Path:
    """<run>/eval."""
    return run_layout(cfg).eval


def manifest_path(cfg: RunConfig) -> Path:
    """<run>/eval/evaluate.manifest.json."""
    return run_layout(cfg).manifest("evaluate")


def default_export_dir(cfg: RunConfig) -> Path:
    """<run>/export/sglang: the SGLang layout the export stage writes."""
    return run_layout(cfg).sglang_export


def stage_key_of(cfg: RunConfig) -> str:
    """The key of evaluating the run's own export (prepares the target to fingerprint it)."""
    from eagle3.target.load import prepare_target

    return key_for(cfg, prepare_target(cfg))


def key_for(cfg: RunConfig, model_dir: Path, export_dir: Path | None = None) -> str:
    """Evaluate section + target fingerprint + the export manifest (or, for an explicit folder, its files' hashes)."""
    from eagle3.target.load import fingerprint
    from infra.storage import sha256_file

    extra: dict[str, Any] = {"target": fingerprint(model_dir)}
    inputs = [run_layout(cfg).manifest("export")]
    if export_dir is not None:
        from eagle3.model_card import CARD_FILE  # rewritten by this stage: never part of what it measured

        files = sorted(p for p in Path(export_dir).iterdir() if p.is_file() and p.name != CARD_FILE)
        extra["export"] = {p.name: sha256_file(p) for p in files}
        inputs = []
    return stage_key("evaluate", section_dict(cfg, "evaluate"), inputs, extra)


def resolve_device(device: str) -> str:
    """'auto' -> cuda when a GPU is visible, else cpu (the capture backend's rule); cuda without one is an error."""
    import torch

    from eagle3.features.hf_backend import resolve_device as resolve_auto

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("evaluate.device is cuda but no CUDA device is visible")
    return resolve_auto(device)


def _settings(cfg: RunConfig, model_dir: Path, export_dir: Path, device: str,
              items: Sequence[tuple[EvalPrompt, list[int]]], stop_ids: list[int]) -> dict[str, Any]:
    import torch
    import transformers

    from eagle3.export import read_json
    from eagle3.target.load import fingerprint

    e = cfg.evaluate
    counts = {d: sum(p.dataset == d for p, _ in items) for d in e.datasets}
    export_cfg = read_json(export_dir / "config.json")
    return {"evaluate": e.model_dump(mode="json"), "target": cfg.target.name, "target_dir": str(model_dir),
            "target_fingerprint": fingerprint(model_dir), "export_dir": str(export_dir),
            "aux_layer_ids": export_cfg.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids"),
            "device": device, "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
            "dtype": e.dtype, "max_new_tokens": e.max_new_tokens, "num_prompts": counts, "stop_ids": stop_ids,
            "ngram": f"n-gram {e.ngram_max} down to {e.ngram_min}, up to {e.ngram_num_tokens} tokens, whole context",
            "methods": [asdict(s) for s in method_specs(e)], "num_workers": e.num_workers,
            "torch": torch.__version__, "transformers": transformers.__version__}


@dataclass
class _Plan:
    """What one evaluation measures: the rendered prompts and the workers' job (device, stop ids, settings)."""

    items: list[tuple[EvalPrompt, list[int]]]
    job: EvalJob


def _plan(cfg: RunConfig, model_dir: Path, export_dir: Path) -> _Plan:
    from eagle3.evaluate.prompts import load_prompts
    from eagle3.target.load import load_tokenizer, stop_token_ids, target_info

    e = cfg.evaluate
    tokenizer = load_tokenizer(model_dir)
    stop_ids = stop_token_ids(tokenizer, target_info(model_dir, cfg.target))
    items = load_prompts(e.datasets, {name: e.limit_for(name) for name in e.datasets}, tokenizer)
    device = resolve_device(e.device)
    threads = max(1, (os.cpu_count() or 1) // e.num_workers) if e.num_workers > 1 else None  # split the cores
    cache_len = max((len(ids) for _, ids in items), default=0) + e.max_new_tokens + 128  # + verify and draft rows
    job = EvalJob(str(model_dir), str(export_dir), e.model_dump(mode="json"), device, stop_ids, threads, cache_len)
    return _Plan(items, job)


def journal_of(cfg: RunConfig) -> Journal:
    """<run>/eval/evaluate.journal.jsonl."""
    return Journal(eval_dir(cfg) / JOURNAL_NAME)


def _report(cfg: RunConfig, model_dir: Path, export_dir: Path, plan: _Plan, records: list[dict[str, Any]],
            out_dir: Path, partial: dict[str, Any] | None = None) -> tuple[dict[str, Path], list[dict[str, Any]]]:
    """Summarize the records and write results, report, plot and prompts into ``out_dir``; (outputs, rows)."""
    rows = summarize_all(records, [s.name for s in method_specs(cfg.evaluate)])
    settings = _settings(cfg, model_dir, export_dir, plan.job.device, plan.items, plan.job.stop_ids)
    if partial:
        settings["partial"] = partial
    return write_outputs(out_dir, records, rows, settings), rows


def _compute(cfg: RunConfig, model_dir: Path, export_dir: Path, progress: ProgressFn | None,
             show_bar: bool | None, key: str) -> tuple[dict[str, Path], dict[str, Any]]:
    e, plan, journal = cfg.evaluate, _plan(cfg, model_dir, export_dir), journal_of(cfg)
    records = evaluate_prompts(plan.job, plan.items, e.num_workers, progress, show_bar, journal=journal, key=key)
    outputs, rows = _report(cfg, model_dir, export_dir, plan, records, eval_dir(cfg))
    journal.path.unlink(missing_ok=True)  # prompts.jsonl now holds every record; a forced re-run measures afresh
    stats = {f"{r['dataset']}/{r['method']}": {k: r[k] for k in ("accept_len", "speedup", "tokens_per_s")}
             | {"lossless_identical": r["lossless"]["identical"], "num_prompts": r["num_prompts"]} for r in rows}
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
    partial = {"num_measured": len(records), "num_planned": len(plan.items),
               "num_measured_by_dataset": {d: sum(r["dataset"] == d for r in records) for d in cfg.evaluate.datasets}}
    return _report(cfg, model_dir, source, plan, records, eval_dir(cfg) / "partial", partial)[0]


def run_evaluate(cfg: RunConfig, progress: ProgressFn | None = None, force: bool = False,
                 export_dir: Path | None = None, show_bar: bool | None = None) -> StageOutcome:
    """Evaluate <run>/export/sglang (or ``export_dir``) on the run's target; skipped when the manifest matches."""
    from eagle3.target.load import prepare_target

    model_dir = prepare_target(cfg)
    source = Path(export_dir) if export_dir is not None else default_export_dir(cfg)
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"no SGLang export at {source} (run the export stage first, or pass --export-dir)")
    key = key_for(cfg, model_dir, export_dir)
    if force:
        journal_of(cfg).path.unlink(missing_ok=True)
    outcome = run_stage("evaluate", manifest_path(cfg), key, force=force,
                        compute=lambda: _compute(cfg, model_dir, source, progress, show_bar, key))
    if export_dir is None:  # the run's own export: its model cards get the table just measured (or still current)
        from eagle3.export import write_cards

        write_cards(cfg, json.loads(Path(outcome.outputs["results"]).read_text()), model_dir)
    return outcome


def main(argv: list[str] | None = None) -> None:
    """python -m eagle3.evaluate.stage --preset X [--set a.b=c] | --config <run>/config.json [--export-dir D] [--force]
    [--partial-report]"""
    from eagle3.run.cli_args import add_config_args, print_json, stage_main

    parser = add_config_args(argparse.ArgumentParser(description=main.__doc__))
    parser.add_argument("--export-dir", type=Path, help="an SGLang export folder (default <run>/export/sglang)")
    parser.add_argument("--force", action="store_true", help="recompute even if the manifest matches")
    parser.add_argument("--partial-report", action="store_true",
                        help="only report the prompts an unfinished evaluation has journaled (<run>/eval/partial/)")

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
    stage_main(parser, argv, run, show=show,
               lock_owner=lambda args: None if args.partial_report else "python -m eagle3.evaluate.stage")


if __name__ == "__main__":
    main()
