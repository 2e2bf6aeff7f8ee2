"""The evaluation's summaries and outputs: per-method rows from the measured records, the markdown report, the
per-position plot and the files of <run>/eval (definitions in eagle3.evaluate.stage's docstring)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from eagle3.evaluate.records import (
    EvalResults,
    EvalSettings,
    LosslessCounts,
    LosslessDifference,
    PromptRecord,
    SummaryRow,
)
from eagle3.run.layout import EVAL_PLOT, PROMPTS_FILE, REPORT_FILE, RESULTS_FILE

REJECTS_FILE = "rejects.jsonl"
"""<run>/eval/: the prompt-file lines an evaluation rejected, one JSON line each (eagle3.data.rejects)."""


def position_acceptance(depths: Sequence[int], accepted: Sequence[int]) -> tuple[list[float], list[float | None]]:
    """Per draft position i = 1..max depth: (steps accepting >= i / steps proposing i, the same over the steps
    proposing i that accepted >= i-1; None where no step got that far)."""
    rates, conditional = [], []
    for i in range(1, max(depths, default=0) + 1):
        proposed = [a for d, a in zip(depths, accepted) if d >= i]
        reached = [a for a in proposed if a >= i - 1]
        hits = sum(a >= i for a in proposed)
        rates.append(hits / len(proposed))
        conditional.append(hits / len(reached) if reached else None)
    return rates, conditional


def summarize(
    records: Sequence[PromptRecord], method: str, dataset: str | None = None, category: str | None = None
) -> SummaryRow:
    """One method over some prompts: acceptance, per-position acceptance, speed, lossless counts (and, when sampled,
    the target's mean log-prob of the method's and the reference's tokens). ``dataset``: the row's name (default: the
    records' one dataset, or "all"); ``category``: the prompt-file category the records share."""
    runs = [r.methods[method] for r in records]
    depths = [d for run in runs for d in run.depth]
    accepted = [a for run in runs for a in run.accepted]
    num_verify, committed = len(depths), sum(c for run in runs for c in run.committed)
    wall_s, reference_s = sum(run.wall_s for run in runs), sum(r.greedy.wall_s for r in records)
    # the one-row baseline where every record has it (a journal resumed across versions may mix): same token counts
    one_row = bool(records) and all(r.greedy.baseline_wall_s is not None for r in records)
    greedy_s = sum(r.greedy.speed_wall_s for r in records) if one_row else reference_s
    reference_tokens = sum(r.greedy.num_tokens for r in records)
    num_tokens = sum(run.num_tokens for run in runs)
    rates, conditional = position_acceptance(depths, accepted)
    kinds = [run.lossless.kind for run in runs]
    names = set(r.dataset for r in records)
    lossless = LosslessCounts(
        kinds.count("identical"),
        kinds.count("near_tie"),
        kinds.count("mismatch"),
        [
            LosslessDifference(r.id, run.lossless)
            for r, run in zip(records, runs)
            if run.lossless.kind not in ("identical", "sampled")
        ],
        kinds.count("sampled"),
    )
    return SummaryRow(
        dataset=dataset or (names.pop() if len(names) == 1 else "all"),
        method=method,
        num_prompts=len(runs),
        num_tokens=num_tokens,
        num_verify=num_verify,
        accept_len=committed / max(num_verify, 1),
        per_position=rates,
        per_position_conditional=conditional,
        wall_s=wall_s,
        tokens_per_s=num_tokens / max(wall_s, 1e-9),
        greedy_wall_s=greedy_s,
        greedy_tokens_per_s=reference_tokens / max(greedy_s, 1e-9),
        speedup=greedy_s / max(wall_s, 1e-9),
        teacher_forced_acc_0=teacher_forced_acc_0(records),
        lossless=lossless,
        category=category,
        logprob_per_token=_per_token([(run.logprob, run.num_tokens) for run in runs]),
        reference_logprob_per_token=_per_token([(r.greedy.logprob, r.greedy.num_tokens) for r in records]),
        reference_tokens_per_s=reference_tokens / max(reference_s, 1e-9) if one_row else None,
    )


def _per_token(pairs: Sequence[tuple[float | None, int]]) -> float | None:
    """Summed log-probs over summed tokens; None unless every decode sampled (greedy records carry none)."""
    if not pairs or any(logprob is None for logprob, _ in pairs):
        return None
    return sum(logprob or 0.0 for logprob, _ in pairs) / max(sum(n for _, n in pairs), 1)


def teacher_forced_acc_0(records: Sequence[PromptRecord]) -> float | None:
    """The drafter's first-draft agreement with the greedy text over these prompts (None if any record lacks it:
    journals written before the cross-check existed)."""
    if not records or any(r.teacher_forced is None for r in records):
        return None
    num_tokens = sum(r.teacher_forced.num_tokens for r in records if r.teacher_forced)
    return sum(r.teacher_forced.num_hits for r in records if r.teacher_forced) / max(num_tokens, 1)


def summarize_categories(records: Sequence[PromptRecord], methods: Sequence[str]) -> list[SummaryRow]:
    """One row per dataset x category x method, for the prompts of prompt files that name a category."""
    keys = list(dict.fromkeys((r.dataset, r.category) for r in records if r.category is not None))
    return [
        summarize([r for r in records if (r.dataset, r.category) == key], m, key[0], key[1])
        for key in keys
        for m in methods
    ]


def summarize_all(records: Sequence[PromptRecord], methods: Sequence[str]) -> list[SummaryRow]:
    """One row per dataset x method, plus an 'all' row per method when there are several datasets."""
    datasets = list(dict.fromkeys(r.dataset for r in records))
    groups = [(d, [r for r in records if r.dataset == d]) for d in datasets]
    if len(datasets) > 1:
        groups.append(("all", list(records)))
    rows = [summarize(group, m, name) for name, group in groups for m in methods]
    ngram_wall_s = {r.dataset: r.wall_s for r in rows if r.method == "ngram"}
    # the baseline without training, measured on the same prompts in the same processes
    return [
        replace(r, speedup_vs_ngram=ngram_wall_s[r.dataset] / max(r.wall_s, 1e-9) if ngram_wall_s else None)
        for r in rows
    ]


# ----------------------------------------------------------------------------------------------- outputs


def _lossless_text(row: SummaryRow) -> str:
    if row.logprob_per_token is not None:  # sampled: support check and log-prob beside the target's own sampling
        text = f"{row.lossless.sampled}/{row.num_prompts} in support; log-prob/token {row.logprob_per_token:.3f}"
        if row.reference_logprob_per_token is not None:
            text += f" (target sampling {row.reference_logprob_per_token:.3f})"
        return text + "".join(f"; {d.check.kind} {d.prompt} @ {d.check.position}" for d in row.lossless.differences)
    text = f"{row.lossless.identical}/{row.num_prompts} identical"
    for diff in row.lossless.differences:
        text += f"; {diff.check.kind} {diff.prompt} @ {diff.check.position}"
    return text


def _rates(values: Sequence[float | None]) -> str:
    return " / ".join("-" if v is None else f"{v:.2f}" for v in values) or "-"


def _kernels_line(settings: EvalSettings) -> str:
    """How the target's decode forwards ran, when the static path padded them to one width (greedy too).
    ``settings.evaluate`` is the resolved section: decode_rows is an int only where the static path used it."""
    rows = settings.evaluate.get("decode_rows")
    if not isinstance(rows, int):
        return ""
    fused = (
        " Each target MLP's gate and up products ran fused (one product)."
        if settings.evaluate.get("fuse_projections")
        else ""
    )
    return (
        f" Static path: every decode forward {rows} rows wide, greedy included, so speedups are against a "
        f"greedy that pays that padding too (docs/evaluate.md measures its cost).{fused}"
    )


def _decoding_words(settings: EvalSettings) -> str:
    """'greedy', or the sampling settings (the evaluate section of results.json)."""
    e = settings.evaluate
    if not e.get("temperature"):
        return "greedy"
    return (
        f"sampling at temperature {e['temperature']} (top-p {e.get('top_p', 1.0)}, top-k {e.get('top_k', 0)}, "
        f"seed {e.get('seed', 0)}; chains {_CHAIN_RULE_WORDS[e.get('chain_sampling', 'rejection')]})"
    )


_CHAIN_RULE_WORDS = {
    "rejection": "drawn from the drafter, the rejection rule",
    "target_only": "the drafter's top tokens, kept with the target's probability",
}


def _sampling_lines(settings: EvalSettings) -> list[str]:
    """At temperature > 0: which check ran instead of token identity."""
    if not settings.evaluate.get("temperature"):
        return []
    return [
        "**Sampled: outputs cannot be token-identical to a reference, so the lossless column shows another "
        "check.** Every committed token must have nonzero probability under the target's distribution (after "
        "temperature, top-k, top-p) at its position (a token outside it is a `mismatch`), and the target's mean "
        "log-prob per token of each method's output sits beside that of the target's own sampling on the same "
        "prompts (equal in expectation when lossless; the gap is sampling noise). The distribution itself is "
        "tested offline by a chi-square test on a tiny target (tests/unit/test_sampling.py). The greedy columns "
        "time the target's own sampling.",
        "",
    ]


def _reject_lines(settings: EvalSettings) -> list[str]:
    if not settings.prompt_rejects:
        return []
    counts = ", ".join(f"{name}: {num}" for name, num in settings.prompt_rejects.items())
    return [f"**Prompt-file lines rejected** (each with its file:line and reason in `rejects.jsonl`): {counts}.", ""]


def _category_lines(by_category: Sequence[SummaryRow]) -> list[str]:
    if not by_category:
        return []
    lines = [
        "",
        "By category (prompt files):",
        "",
        "| dataset | category | method | prompts | accept len | per-position acceptance | tok/s | speedup | lossless |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in by_category:
        lines.append(
            f"| {r.dataset} | {r.category} | {r.method} | {r.num_prompts} | {r.accept_len:.3f} | "
            f"{_rates(r.per_position)} | {r.tokens_per_s:.1f} | {r.speedup:.2f}x | {_lossless_text(r)} |"
        )
    return lines


def report_markdown(rows: Sequence[SummaryRow], settings: EvalSettings, by_category: Sequence[SummaryRow] = ()) -> str:
    """The results table (and the settings it was measured with) as markdown."""
    lines = [
        "# Offline speculative decoding",
        "",
        f"Target `{settings.target}` ({settings.device}, {settings.dtype}); drafter "
        f"`{settings.export_dir}`; {settings.max_new_tokens} new tokens per prompt, {_decoding_words(settings)}; "
        "prompts: first "
        f"N in file order ({', '.join(f'{k} {v}' for k, v in settings.num_prompts.items())}); n-gram: "
        f"{settings.ngram}; workers: {settings.num_workers}.{_kernels_line(settings)}",
        "",
        *_partial_lines(settings),
        *_sampling_lines(settings),
        *_reject_lines(settings),
        *_contention_lines(settings),
        *_fallback_lines(settings),
        *_baseline_lines(rows, settings),
        "| dataset | method | prompts | accept len | per-position acceptance | conditional | tok/s | "
        "greedy tok/s | speedup | vs n-gram | lossless |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        flag = " (!)" if r.speedup > r.accept_len else ""  # cannot happen unless the timing is wrong
        vs_ngram = "-" if r.speedup_vs_ngram is None else f"{r.speedup_vs_ngram:.2f}x"
        lines.append(
            f"| {r.dataset} | {r.method} | {r.num_prompts} | {r.accept_len:.3f} | "
            f"{_rates(r.per_position)} | {_rates(r.per_position_conditional)} | {r.tokens_per_s:.1f} | "
            f"{r.greedy_tokens_per_s:.1f} | {r.speedup:.2f}x{flag} | {vs_ngram} | {_lossless_text(r)} |"
        )
    lines += _category_lines(by_category)
    lines += _teacher_forced_lines(rows)
    lines += [
        "",
        "accept len: tokens per verify forward, bonus token included. per-position: draft position i "
        "accepted / proposed; conditional: given positions < i were accepted. speedup: greedy wall time / "
        "method wall time, same prompts, same process; vs n-gram: n-gram wall time / method wall time. (!) marks "
        "speedup > accept len: a timing error.",
    ]
    return "\n".join(lines) + "\n"


def _teacher_forced_lines(rows: Sequence[SummaryRow]) -> list[str]:
    """Per dataset: the drafter's teacher-forced acc_0 on the greedy text next to the chains' position-1
    acceptance; the two agree when the decode feeds the drafter what training did."""
    chains = [r for r in rows if r.method.startswith("chain") and r.teacher_forced_acc_0 is not None]
    if not chains:
        return []
    lines = [
        "",
        "Cross-check: the drafter's first draft token, teacher-forced on the greedy text (TTT step 0 as "
        "training computes it), against the chains' position-1 acceptance:",
        "",
    ]
    for dataset in dict.fromkeys(r.dataset for r in chains):
        rates = ", ".join(f"{r.method} {r.per_position[0]:.3f}" for r in chains if r.dataset == dataset)
        tf = next(r.teacher_forced_acc_0 for r in chains if r.dataset == dataset)
        lines.append(f"- {dataset}: teacher-forced acc_0 {tf:.3f}; position 1 accepted: {rates}")
    return lines


def _baseline_lines(rows: Sequence[SummaryRow], settings: EvalSettings) -> list[str]:
    """Which decode the greedy column times: the one-row baseline (and the reference's own rate beside it)."""
    timed = [r for r in rows if r.reference_tokens_per_s is not None]
    if not timed:
        return []
    first = timed[-1]  # the 'all' row where there is one
    rows_word = settings.evaluate.get("decode_rows")
    return [
        f"**greedy tok/s is plain decoding at one row a forward** (each prompt's reference length decoded again "
        f"and timed, `evaluate.speed_baseline`): {first.greedy_tokens_per_s:.1f} tok/s over {first.dataset}, "
        f"against {first.reference_tokens_per_s:.1f} for the reference at {rows_word} rows a forward, which "
        "every method's output is checked against. Speedups divide by the one-row time.",
        "",
    ]


def _contention_lines(settings: EvalSettings) -> list[str]:
    if settings.num_workers <= 1:
        return []
    return [
        f"**Speeds measured by {settings.num_workers} processes sharing one {settings.device} device:** "
        "acceptance is unaffected, but tok/s and speedups include their contention. Time an isolated subset "
        "with `evaluate.num_workers=1`.",
        "",
    ]


def _fallback_lines(settings: EvalSettings) -> list[str]:
    if not settings.decode_fallbacks:
        return []
    steps = "; ".join(f"{name}: {why}" for name, why in sorted(settings.decode_fallbacks.items()))
    return [
        f"**Ran on eager kernels after a compile or CUDA-graph capture failed** (their tok/s are slower than "
        f"the compiled path's): {steps}.",
        "",
    ]


def _partial_lines(settings: EvalSettings) -> list[str]:
    partial = settings.partial
    if not partial:
        return []
    return [
        f"**PARTIAL: {partial.num_measured} of {partial.num_planned} prompts measured** (read from the "
        "journal of an evaluation that has not finished; the planned counts above are not all measured).",
        "",
    ]


def plot_per_position(rows: Sequence[SummaryRow], out: Path) -> Path:
    """per_position.png: acceptance per draft position, one panel per dataset, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    datasets = list(dict.fromkeys(r.dataset for r in rows))
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.5 * len(datasets), 3.6), dpi=110, squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        for r in (r for r in rows if r.dataset == dataset):
            x = list(range(1, len(r.per_position) + 1))
            (line,) = ax.plot(x, r.per_position, "o-", ms=3, label=f"{r.method} (AL {r.accept_len:.2f})")
            conditional = [float("nan") if v is None else v for v in r.per_position_conditional]
            ax.plot(x, conditional, "--", color=line.get_color(), lw=1)
        ax.set(title=dataset, xlabel="draft position", ylabel="acceptance (dashed: conditional)", ylim=(0, 1.02))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    from infra.storage import atomic_path

    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png")  # the temp name has no .png suffix
    plt.close(fig)
    return out


def write_outputs(
    out_dir: Path,
    records: Sequence[PromptRecord],
    rows: list[SummaryRow],
    settings: EvalSettings,
    by_category: Sequence[SummaryRow] = (),
    rejects: Sequence[Any] = (),
) -> dict[str, Path]:
    """results.json, report.md, per_position.png, prompts.jsonl and, when prompt-file lines were rejected,
    rejects.jsonl (eagle3.data.rejects' lines) (atomic writes)."""
    from infra.storage import atomic_write_bytes, atomic_write_json, atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    results = EvalResults(settings, rows, list(by_category)).to_json()
    outputs = {
        "results": atomic_write_json(out_dir / RESULTS_FILE, results),
        "report": atomic_write_text(out_dir / REPORT_FILE, report_markdown(rows, settings, by_category)),
        "prompts": atomic_write_text(out_dir / PROMPTS_FILE, "".join(json.dumps(r.to_json()) + "\n" for r in records)),
    }
    if rejects:
        from eagle3.data.rejects import reject_line

        outputs["rejects"] = atomic_write_bytes(out_dir / REJECTS_FILE, b"".join(reject_line(r) for r in rejects))
    outputs["plot"] = plot_per_position(rows, out_dir / EVAL_PLOT)
    return outputs
