"""Compare a speculative SGLang server's benchmark with its baseline's: per level, per prompt group, and a report.

``compare`` gives the speedup spec/baseline per level and raises ``MeasurementError`` when it exceeds the
acceptance length: a speculative server cannot emit more tokens per target forward than it accepts, so such a
ratio means one of the two runs measured something else. The runs themselves come from infra/sglang_bench.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from infra.sglang_bench_records import SHARED_SETTINGS, BenchResult, LevelResult, MeasurementError


@dataclass(frozen=True)
class LevelComparison:
    """Baseline vs speculative at one concurrency."""

    concurrency: int
    baseline_tok_per_s: float
    speculative_tok_per_s: float
    speedup: float
    accept_length: float
    server_accept_length: float | None
    baseline_tpot_ms: float
    speculative_tpot_ms: float
    baseline_p90_latency_s: float
    speculative_p90_latency_s: float
    identical_outputs: int
    num_requests: int


def comparable_problems(baseline: BenchResult, speculative: BenchResult) -> list[str]:
    """Why two runs cannot be compared (empty when they can)."""
    problems = []
    if baseline.speculative or not speculative.speculative:
        problems.append("need one baseline run and one speculative run")
    if baseline.settings != speculative.settings:
        problems.append(f"benchmark settings differ: {baseline.settings} vs {speculative.settings}")
    if baseline.prompts_digest != speculative.prompts_digest:
        problems.append("the runs used different prompts")
    for key in SHARED_SETTINGS:
        b, s = baseline.server_settings.get(key), speculative.server_settings.get(key)
        if b != s:
            problems.append(f"servers differ in {key}: baseline {b!r}, speculative {s!r}")
    return problems


def compare(baseline: BenchResult, speculative: BenchResult) -> list[LevelComparison]:
    """Speedup per level; MeasurementError for incomparable runs or a speedup above the acceptance length."""
    problems = comparable_problems(baseline, speculative)
    if problems:
        raise MeasurementError("baseline and speculative runs are not comparable:\n  " + "\n  ".join(problems))
    rows = [_compare_level(b, s) for b, s in zip(baseline.levels, speculative.levels, strict=True)]
    impossible = [
        f"concurrency {r.concurrency}: speedup {r.speedup:.3f} > acceptance length {r.accept_length:.3f}"
        for r in rows
        if r.speedup > r.accept_length
    ]
    if impossible:
        raise MeasurementError(
            "speedup above the acceptance length, which no speculative server can reach (each verify step "
            "costs at least one target forward); one run measured something else (a busy GPU during the "
            "baseline, cache hits, other settings):\n  " + "\n  ".join(impossible)
        )
    return rows


def _compare_level(b: LevelResult, s: LevelResult) -> LevelComparison:
    assert s.accept_length is not None, "a speculative level always has an acceptance length"
    identical = sum(x == y for x, y in zip(b.output_digests, s.output_digests))
    return LevelComparison(
        b.concurrency,
        b.output_tok_per_s,
        s.output_tok_per_s,
        s.output_tok_per_s / b.output_tok_per_s,
        s.accept_length,
        s.server_accept_length,
        b.median_tpot_ms,
        s.median_tpot_ms,
        b.p90_latency_s,
        s.p90_latency_s,
        identical,
        b.num_requests,
    )


def where_it_pays(rows: Sequence[LevelComparison]) -> str:
    """One line: the concurrency levels at which speculation was faster than the baseline, and those where not."""
    pays = [str(r.concurrency) for r in rows if r.speedup > 1.0]
    not_pays = [str(r.concurrency) for r in rows if r.speedup <= 1.0]
    if not not_pays:
        return f"Speculation paid at every concurrency measured ({', '.join(pays)})."
    if not pays:
        return f"Speculation did not pay at any concurrency measured ({', '.join(not_pays)})."
    return f"Speculation paid at concurrency {', '.join(pays)}; it did not at {', '.join(not_pays)}."


def render_report(
    rows: Sequence[LevelComparison],
    baseline: BenchResult,
    speculative: BenchResult,
    context: dict[str, str],
    drafter: str = "EAGLE-3",
) -> str:
    """Markdown: setup lines, one table row per level, and the metric definitions (``drafter``: the family served)."""
    st = baseline.settings
    lines = [f"# {drafter} deploy benchmark", ""] + [f"* {k}: `{v}`" for k, v in context.items()]
    lines += [
        f"* SGLang version (server): `{speculative.server_settings.get('version')}`",
        f"* prompts: {st.num_prompts} (digest `{baseline.prompts_digest}`), {st.sampling_words()}, "
        f"max_new_tokens {st.max_new_tokens} "
        + ("with ignore_eos" if st.ignore_eos else "or end of turn")
        + f", {st.num_warmup} warmup requests then /flush_cache before each level",
        "",
        f"| concurrency | baseline tok/s | {drafter} tok/s | speedup | accept length (server) | "
        "TPOT ms base / spec | p90 latency s base / spec | identical outputs |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        server = f" ({r.server_accept_length:.2f})" if r.server_accept_length is not None else ""
        lines.append(
            f"| {r.concurrency} | {r.baseline_tok_per_s:,.1f} | {r.speculative_tok_per_s:,.1f} | "
            f"{r.speedup:.2f}x | {r.accept_length:.2f}{server} | {r.baseline_tpot_ms:.2f} / "
            f"{r.speculative_tpot_ms:.2f} | {r.baseline_p90_latency_s:.3f} / "
            f"{r.speculative_p90_latency_s:.3f} | {identical_cell(r.identical_outputs, r.num_requests, st.sampled)} |"
        )
    lines += ["", where_it_pays(rows)]
    lines += [
        "",
        f"speedup = {drafter} output tok/s / baseline output tok/s; accept length = sum completion_tokens / "
        "sum spec_verify_ct (bonus token included; in brackets SGLang's avg_spec_accept_length since the "
        "flush); checked: speedup <= accept length at every level. Identical outputs: greedy outputs equal "
        "to the baseline's (numerics of batched kernels may legitimately differ); sampled outputs differ by "
        "chance, so none are counted.",
    ]
    return "\n".join(lines) + "\n"


def identical_cell(identical: int, num: int, sampled: bool) -> str:
    """A table's identical-outputs cell: 'k/n', or 'sampled' where requests sampled (no identity to expect)."""
    return "sampled" if sampled else f"{identical}/{num}"


@dataclass(frozen=True)
class GroupComparison:
    """Baseline vs speculative over one group of prompts (a dataset) at one concurrency.

    Requests of all groups share each level's wall time, so a group's rate is per request: sum of its tokens
    over the sum of its requests' latencies (at concurrency 1 that is the throughput of those prompts)."""

    concurrency: int
    group: str
    num_requests: int
    baseline_tok_per_s: float
    speculative_tok_per_s: float
    speedup: float
    accept_length: float
    identical_outputs: int


def group_indices(groups: Sequence[str]) -> list[tuple[str, list[int]]]:
    """(group, its prompts' indices) per group in first-seen order, then ("all", every index)."""
    return [(name, [i for i, g in enumerate(groups) if name in ("all", g)]) for name in [*dict.fromkeys(groups), "all"]]


def compare_groups(baseline: BenchResult, speculative: BenchResult, groups: Sequence[str]) -> list[GroupComparison]:
    """Per level and group (``groups[i]`` names prompt i's group), then "all"; same checks as ``compare``."""
    rows = []
    for b, s in zip(baseline.levels, speculative.levels, strict=True):
        if len(b.completion_by_prompt) != len(groups) or len(s.completion_by_prompt) != len(groups):
            raise MeasurementError(
                f"concurrency {b.concurrency}: per-prompt figures for "
                f"{len(b.completion_by_prompt)}/{len(s.completion_by_prompt)} prompts, "
                f"{len(groups)} prompt groups"
            )
        rows += [_group_row(b, s, name, idx) for name, idx in group_indices(groups)]
    return rows


def _group_row(b: LevelResult, s: LevelResult, name: str, idx: Sequence[int]) -> GroupComparison:
    def rate(level: LevelResult) -> float:
        return sum(level.completion_by_prompt[i] for i in idx) / sum(level.latency_by_prompt[i] for i in idx)

    verify = sum(s.verify_by_prompt[i] for i in idx)
    identical = sum(b.output_digests[i] == s.output_digests[i] for i in idx)
    return GroupComparison(
        b.concurrency,
        name,
        len(idx),
        rate(b),
        rate(s),
        rate(s) / rate(b),
        sum(s.completion_by_prompt[i] for i in idx) / verify if verify else float("nan"),
        identical,
    )


def render_group_table(rows: Sequence[GroupComparison], drafter: str = "EAGLE-3", sampled: bool = False) -> str:
    """Markdown table: per concurrency and dataset, accept length, per-request tok/s, speedup, identical outputs
    (``sampled``: requests sampled, so none are counted)."""
    lines = [
        f"| concurrency | dataset | prompts | accept length | baseline tok/s per request | {drafter} tok/s per "
        "request | speedup | identical to baseline |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.concurrency} | {r.group} | {r.num_requests} | {r.accept_length:.3f} | {r.baseline_tok_per_s:,.1f} "
        f"| {r.speculative_tok_per_s:,.1f} | {r.speedup:.2f}x | "
        f"{identical_cell(r.identical_outputs, r.num_requests, sampled)} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"
