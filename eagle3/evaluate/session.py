"""One evaluating process: the drafting methods the config asks for, the loaded session (target runner, drafter
runner, a proposer per method) and the measurement of one prompt (greedy reference, then every method).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3.config import EvaluateConfig
from eagle3.evaluate.prompts import EvalPrompt
from eagle3.evaluate.records import GreedyReference, MethodRun, MethodSpec, PromptRecord, TeacherForced

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import Tensor

    from eagle3.drafter.model import Eagle3Drafter
    from eagle3.evaluate.graphs import CompileSettings
    from eagle3.evaluate.runners import DrafterRunner, TargetRunner
    from eagle3.evaluate.sampling import SamplingParams

WARMUP_TOKENS = 8
"""Tokens each method generates on the first prompt before anything is timed (kernels, allocator, caches)."""


# ------------------------------------------------------------------------------------------------- methods


def method_specs(ecfg: EvaluateConfig, dflash_block: int | None = None) -> list[MethodSpec]:
    """The methods the config asks for, in a fixed order: chains (by steps), tree, n-gram. With a DFlash drafter
    (``dflash_block``: its block size K) chain and tree are its one way of drafting: a block of K-1 drafts, K tokens
    verified (SGLang's DFlash runs steps 1, topk 1, K draft tokens), named dflash-{K-1}-1-{K}."""
    specs = []
    if dflash_block is not None and {"chain", "tree"} & set(ecfg.methods):
        k = dflash_block
        specs.append(MethodSpec(f"dflash-{k - 1}-1-{k}", "dflash", k - 1, 1, k))
    if dflash_block is None and "chain" in ecfg.methods:
        specs += [MethodSpec(f"chain-{s}-1-{s + 1}", "chain", s, 1, s + 1) for s in sorted(set(ecfg.chain_steps))]
    if dflash_block is None and "tree" in ecfg.methods:
        s, k, n = ecfg.tree_steps, ecfg.tree_topk, ecfg.tree_num_draft_tokens
        specs.append(MethodSpec(f"tree-{s}-{k}-{n}", "tree", s, k, n))
    if "ngram" in ecfg.methods:
        specs.append(MethodSpec("ngram", "ngram", ecfg.ngram_num_tokens, 1, ecfg.ngram_num_tokens + 1))
    return specs


def make_proposer(
    spec: MethodSpec,
    ecfg: EvaluateConfig,
    drafter: Any = None,
    d2t: Any = None,
    runner: Any = None,
    static: tuple[int, CompileSettings] | None = None,
) -> Any:
    """The Proposer of a method (EAGLE methods need the drafter and its d2t; ``runner``: a shared drafter runner;
    ``static``: (cache capacity, compile settings) of a DFlash drafter's fixed-size cache, None for the growing one)."""
    from eagle3.evaluate.proposers import EagleProposer, NgramProposer

    if spec.kind == "ngram":
        return NgramProposer(ecfg.ngram_max, ecfg.ngram_min, ecfg.ngram_num_tokens)
    if drafter is None:
        raise ValueError(f"method {spec.name} needs a drafter")
    if spec.kind == "dflash" and static is not None:
        from eagle3.evaluate.dflash_static import StaticDFlashProposer

        return StaticDFlashProposer(drafter, *static)
    if spec.kind == "dflash":
        from eagle3.evaluate.dflash_decode import DFlashProposer

        return DFlashProposer(drafter)
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
    drafter: Any  # DrafterRunner of its own, for the teacher-forced cross-check (None for a DFlash drafter)
    ecfg: EvaluateConfig
    stop_ids: list[int]
    baseline: Any = None  # TargetRunner at one row a forward on the same model: the speed baseline (speed_baseline)


def baseline_runner(target: Any, ecfg: EvaluateConfig, settings: CompileSettings, capacity: int) -> TargetRunner | None:
    """A static runner at one row a forward over ``target``'s model (weights shared, a cache of its own), when
    ``ecfg`` (resolved) times speedups against one-row decoding; None otherwise."""
    from eagle3.evaluate.static_target import StaticTargetRunner

    if ecfg.speed_baseline != "one_row":
        return None
    return StaticTargetRunner(
        target.model,
        target.aux_layer_ids,
        capacity,
        settings,
        1,
        name="one-row baseline",
        attention=ecfg.baseline_attention,
    )


def make_runners(
    model: Any,
    aux_layer_ids: Sequence[int],
    drafter: Eagle3Drafter | None,
    d2t: Tensor | None,
    static: bool,
    compile_settings: CompileSettings,
    capacity: int = 1024,
    decode_rows: int | None = None,
    gathered_keys: bool = False,
) -> tuple[TargetRunner, DrafterRunner | None]:
    """The target runner and one drafter runner (None without a drafter), static or eager."""
    from eagle3.evaluate.runners import DrafterRunner, TargetRunner
    from eagle3.evaluate.static_drafter import StaticDrafterRunner
    from eagle3.evaluate.static_target import StaticTargetRunner

    if drafter is not None and d2t is None:
        raise ValueError("a drafter runs with its d2t map (draft-to-target id offsets)")
    if not static:
        if compile_settings.enabled:
            raise ValueError("compiled decoding needs the static cache")
        eager = TargetRunner(model, aux_layer_ids)
        return eager, None if drafter is None or d2t is None else DrafterRunner(drafter, d2t)
    target = StaticTargetRunner(model, aux_layer_ids, capacity, compile_settings, decode_rows, gathered_keys)
    runner = (
        None
        if drafter is None or d2t is None
        else StaticDrafterRunner(drafter, d2t, capacity, compile_settings, decode_rows)
    )
    return target, runner


def open_session(job: EvalJob) -> EvalSession:
    """Load the target and the exported drafter on the job's device; one drafter runner serves every method."""
    import torch

    from eagle3.evaluate.fused_projections import fuse_projections
    from eagle3.evaluate.graphs import resolve_decode
    from eagle3.export.sglang import load_sglang_export
    from eagle3.target.load import load_model

    ecfg = EvaluateConfig.model_validate(job.evaluate).resolved(job.device)
    if dflash_block_size(Path(job.export_dir)) is not None:
        return _open_dflash_session(job, ecfg)
    loaded = load_sglang_export(Path(job.export_dir), Path(job.model_dir), job.device, getattr(torch, ecfg.dtype))
    model = load_model(Path(job.model_dir), ecfg.dtype, job.device)
    static, settings = resolve_decode(ecfg.static_cache, ecfg.compile, job.device)
    if static and ecfg.fuse_projections:
        fuse_projections(model)
    assert not isinstance(ecfg.decode_rows, str), "resolved() decides decode_rows"
    target, runner = make_runners(
        model,
        loaded.aux_layer_ids,
        loaded.drafter,
        loaded.d2t,
        static,
        settings,
        job.cache_len,
        ecfg.decode_rows,
        ecfg.decode_keys == "gathered",
    )
    proposers = {s.name: make_proposer(s, ecfg, loaded.drafter, loaded.d2t, runner) for s in method_specs(ecfg)}
    baseline = baseline_runner(target, ecfg, settings, job.cache_len)
    return EvalSession(target, proposers, runner, ecfg, list(job.stop_ids), baseline)


def dflash_block_size(export_dir: Path) -> int | None:
    """The block size of a DFlash export (SGLang's DFlashDraftModel layout), None for an EAGLE-3 one."""
    from eagle3.export.checks import CONFIG_FILE, read_json
    from eagle3.export.dflash import DFLASH_ARCHITECTURE, dflash_dims

    path = Path(export_dir) / CONFIG_FILE
    config = read_json(path)
    if config.get("architectures") != [DFLASH_ARCHITECTURE]:
        return None
    return dflash_dims(config, path)[0].block_size  # its fields checked (ExportError naming the file)


def _open_dflash_session(job: EvalJob, ecfg: EvaluateConfig) -> EvalSession:
    """A DFlash export: the target runner reads the drafter's target layers, one DFlash proposer per method (no
    EAGLE-3 drafter runner, so no teacher-forced cross-check)."""
    import torch

    from eagle3.evaluate.fused_projections import fuse_projections
    from eagle3.evaluate.graphs import resolve_decode
    from eagle3.export.dflash import load_dflash_export
    from eagle3.target.load import load_model

    loaded = load_dflash_export(Path(job.export_dir), Path(job.model_dir), job.device, getattr(torch, ecfg.dtype))
    block, rows = loaded.drafter.dims.block_size, ecfg.decode_rows
    static, settings = resolve_decode(ecfg.static_cache, ecfg.compile, job.device)
    if static and isinstance(rows, int) and block > rows:
        raise ValueError(
            f"evaluate.decode_rows {rows} is narrower than the DFlash block ({block} tokens verified "
            f"per round): set evaluate.decode_rows to at least {block}"
        )
    model = load_model(Path(job.model_dir), ecfg.dtype, job.device)
    if static and ecfg.fuse_projections:
        fuse_projections(model)
    assert not isinstance(rows, str), "resolved() decides decode_rows"
    target, _ = make_runners(
        model,
        loaded.target_layer_ids,
        None,
        None,
        static,
        settings,
        job.cache_len,
        rows,
        ecfg.decode_keys == "gathered",
    )
    cache = (job.cache_len, settings) if static else None
    proposers = {s.name: make_proposer(s, ecfg, loaded.drafter, static=cache) for s in method_specs(ecfg, block)}
    baseline = baseline_runner(target, ecfg, settings, job.cache_len)
    return EvalSession(target, proposers, None, ecfg, list(job.stop_ids), baseline)


def ready_session(job: EvalJob, warmup_ids: list[int]) -> EvalSession:
    """open_session then warm_up, each timed on stderr (an evaluation's start, which no decode time includes),
    with the compile and capture seconds of every step."""
    from eagle3.evaluate.graphs import warmup_summary

    start = time.perf_counter()
    session = open_session(job)
    loaded = time.perf_counter()
    warm_up(session, warmup_ids)
    print(
        f"evaluate: target and drafter loaded in {loaded - start:.1f} s, warm-up (every forward width and "
        f"method compiled or captured) {time.perf_counter() - loaded:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    summary = warmup_summary(compiled_steps(session))
    if summary:
        print(f"evaluate: warm-up by step: {summary}", file=sys.stderr, flush=True)
    return session


def eval_sampling(ecfg: EvaluateConfig) -> SamplingParams | None:
    """The evaluate section's sampling settings (None at temperature 0: greedy)."""
    from eagle3.evaluate.sampling import sampling_params

    return sampling_params(ecfg.temperature, ecfg.top_p, ecfg.top_k, ecfg.chain_sampling)


def warm_up(session: EvalSession, prompt_ids: list[int]) -> None:
    """Run every forward width of the static runners (compiles them), then the reference and every method briefly
    (sampling at temperature > 0); untimed."""
    from eagle3.evaluate.sampled_decode import decode_method, decode_reference

    for runner in (session.target, session.drafter, session.baseline):
        getattr(runner, "warm_up_widths", lambda: None)()
    ecfg = session.ecfg
    num, params = min(WARMUP_TOKENS, ecfg.max_new_tokens), eval_sampling(ecfg)
    decode_reference(session.target, prompt_ids, num, session.stop_ids, params, ecfg.seed, "warm-up")
    if session.baseline is not None:
        decode_reference(session.baseline, prompt_ids, num, [], params, ecfg.seed, "warm-up")
    for proposer in session.proposers.values():
        decode_method(session.target, proposer, prompt_ids, num, session.stop_ids, params, ecfg.seed, "warm-up")


def evaluate_prompt(session: EvalSession, index: int, prompt: EvalPrompt, ids: list[int]) -> PromptRecord:
    """The reference (greedy, or the target's own sampling at temperature > 0) and every method on one prompt: tokens,
    steps, wall times, lossless checks (token identity; at temperature > 0 eagle3.evaluate.sampled_decode's)."""
    import torch

    from eagle3.evaluate.sampled_decode import decode_method, decode_reference, sampled_check
    from eagle3.evaluate.speculate import check_lossless, draft_hits, teacher_forced_drafts

    ecfg = session.ecfg
    params = eval_sampling(ecfg)  # None: greedy
    ref = decode_reference(
        session.target, ids, ecfg.max_new_tokens, session.stop_ids, params, ecfg.seed, f"{prompt.id}/reference"
    )
    baseline_s = None
    if session.baseline is not None:  # the reference's length again at one row, no stop test: the same work, timed
        stream = f"{prompt.id}/reference"
        baseline_s = decode_reference(session.baseline, ids, len(ref.tokens), [], params, ecfg.seed, stream).wall_s
    teacher_forced = None
    if session.drafter is not None:  # an EAGLE-3 drafter: its first draft at every greedy position
        start = time.perf_counter()
        drafts = teacher_forced_drafts(session.target, session.drafter, ids, ref.tokens)  # host lists: synchronised
        teacher_forced = TeacherForced(
            len(drafts), draft_hits(drafts, ref.tokens), round(time.perf_counter() - start, 4)
        )
    methods = {}
    for name, proposer in session.proposers.items():
        out = decode_method(
            session.target,
            proposer,
            ids,
            ecfg.max_new_tokens,
            session.stop_ids,
            params,
            ecfg.seed,
            f"{prompt.id}/{name}",
        )
        check = (
            check_lossless(ref, out.tokens, ecfg.near_tie_logit_gap, getattr(torch, ecfg.dtype))
            if params is None
            else sampled_check(out)
        )
        methods[name] = MethodRun(
            len(out.tokens),
            out.wall_s,
            check,
            [s.draft_depth for s in out.steps],
            [s.accepted for s in out.steps],
            [s.committed for s in out.steps],
            out.tokens if check.kind != "identical" else None,
            out.logprob,
        )
    return PromptRecord(
        index,
        prompt.dataset,
        prompt.id,
        len(ids),
        GreedyReference(len(ref.tokens), ref.wall_s, ref.tokens, ref.logprob, baseline_s),
        teacher_forced,
        methods,
        decode_fallbacks(session),
        prompt.category,
    )


def decode_fallbacks(session: EvalSession) -> dict[str, str]:
    """{step: why} for the session's compiled or graphed steps that fell back to eager kernels so far."""
    from eagle3.evaluate.graphs import fallbacks

    return fallbacks(compiled_steps(session))


def compiled_steps(session: EvalSession) -> list[Any]:
    """The session's CompiledStep functions: the target runner's, the drafter runner's, the one-row baseline's and
    the proposers' own (a DFlash block)."""
    drafter = session.drafter.compiled_steps() if session.drafter is not None else []
    baseline = session.baseline.compiled_steps() if session.baseline is not None else []
    own = [step for p in session.proposers.values() for step in getattr(p, "compiled_steps", list)()]
    return [*session.target.compiled_steps(), *drafter, *baseline, *own]
