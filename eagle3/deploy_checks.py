"""The deploy stage's train/serve parity checks: SGLang's accept length against ``eagle3 eval``'s for the same
export, prompts and drafting (an EAGLE-3 trio's chain or tree; a DFlash drafter's ``dflash-{K-1}-1-{K}``).

Two comparisons, both at the lowest concurrency measured:

* ``accept_checks``: per dataset and overall, every prompt (sum of tokens / sum of verify steps on each side). A
  gap above ``serve.accept_tolerance`` fails the deploy stage. It also moves when greedy texts diverge (bf16
  near-ties in other kernels): a prompt drafted on other text has another accept length.
* ``same_text_checks``: only the prompts whose output is token-identical on both sides, verify steps compared on
  that same text. Divergence cannot move it, so a gap here points at the drafter as served (aux-layer ids, norms,
  d2t/t2d, RoPE, dtype), not at the text; it is reported beside the first and fails the stage the same way.

SGLang's n-gram server (serve.ngram) gets neither: its drafting is another algorithm than eagle3 eval's n-gram
method, so ``ngram_beside_eval`` only puts the two accept lengths side by side.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pathlib import Path

    from eagle3.config import RunConfig
    from eagle3.evaluate.records import PromptRecord
    from infra.sglang_bench import BenchResult, LevelResult


class ServerRun(Protocol):
    """What the checks read of a speculative server's benchmark (eagle3.deploy_records.ServerRun is one)."""

    @property
    def trio(self) -> str | None: ...

    @property
    def result(self) -> BenchResult: ...

    @property
    def groups(self) -> tuple[str, ...]: ...


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "chain_sampling")
"""The evaluate fields the deploy benchmark's requests and chain servers follow, so its accept lengths compare with
eagle3 eval's (chain_sampling matters only at temperature > 0)."""

MISMATCH_HINT = "a train/serve mismatch (aux layer ids, norms, d2t/t2d, RoPE, chat template or dtype)"


@dataclass(frozen=True)
class AcceptCheck:
    """SGLang's accept length against eagle3 eval's for one method and dataset, on the same prompts and export."""

    trio: str
    dataset: str
    sglang: float
    evaluate: float
    rel_diff: float
    ok: bool


def eval_method_name(trio: str, family: str = "eagle3") -> str:
    """The evaluate stage's name for the same drafting: chain-S-1-N, or tree-S-K-N; a DFlash drafter's dflash-S-1-N
    (eagle3.evaluate.session.method_specs names it so)."""
    from eagle3.config_sglang import parse_trio

    steps, topk, tokens = parse_trio(trio)
    kind = "dflash" if family == "dflash" else "chain" if topk == 1 else "tree"
    return f"{kind}-{steps}-{topk}-{tokens}"


def drafter_label(cfg: RunConfig) -> str:
    """The served drafter family as the report names it."""
    return "DFlash" if cfg.drafter.family == "dflash" else "EAGLE-3"


def setting_label(cfg: RunConfig, trio: str) -> str:
    """One speculative server as the report names it: 'EAGLE-3 3-1-4', 'DFlash 15-1-16', or 'n-gram'."""
    return NGRAM_LABEL if trio == NGRAM else f"{drafter_label(cfg)} {trio}"


def dflash_trio(cfg: RunConfig) -> str:
    """A DFlash drafter's one way of drafting, as a trio: K-1 drafts in one block, top-1, K tokens verified per round
    (SGLang's DFLASH runs steps 1, topk 1, K draft tokens), K the served export's block size."""
    from eagle3.config_base import ConfigError
    from eagle3.export.checks import CONFIG_FILE, read_json
    from eagle3.export.dflash import dflash_dims

    if cfg.serve.extra_speculative:
        raise ConfigError(
            f"serve.extra_speculative {cfg.serve.extra_speculative} lists EAGLE-3 settings; a DFlash "
            "drafter (drafter.family=dflash) is served one way, its export's block size: leave it empty"
        )
    path = draft_dir(cfg) / CONFIG_FILE
    block = dflash_dims(read_json(path), path)[0].block_size  # ExportError naming the file when not a DFlash export
    return f"{block - 1}-1-{block}"


def draft_dir(cfg: RunConfig) -> Path:
    """The drafter the servers load: the run's promoted one (the folder <run>/promoted/current points at, once a
    refresh or `eagle3 promote` promoted one: eagle3.refresh.line), else the exported SGLang drafter (the folder
    the evaluate stage reads too)."""
    from eagle3.evaluate.stage import default_export_dir
    from eagle3.refresh.line import Line

    return Line(cfg.run_dir).current_dir() or default_export_dir(cfg)


def serves_own_export(cfg: RunConfig) -> bool:
    """Whether the drafter the servers load (draft_dir) has the weights of the run's own export."""
    from eagle3.export.checks import WEIGHTS_FILE
    from eagle3.run.layout import run_layout
    from infra.storage import sha256_file_cached

    served, own = draft_dir(cfg) / WEIGHTS_FILE, run_layout(cfg).sglang_export / WEIGHTS_FILE
    return served == own or (own.is_file() and sha256_file_cached(served) == sha256_file_cached(own))


def accept_checks(cfg: RunConfig, run: ServerRun) -> tuple[list[AcceptCheck], str | None]:
    """Per dataset and overall, at the lowest concurrency: (checks, why none were made)."""
    if cfg.serve.prompts == "evaluation" and not serves_own_export(cfg):
        return [], (
            "the servers load a promoted drafter whose weights differ from the run's export (what eagle3 eval "
            "measured): its gate table is in promoted/README.md"
        )
    assert run.trio is not None
    method = eval_method_name(run.trio, cfg.drafter.family)
    rows, skipped = eval_rows(cfg, method)
    if skipped:
        return [], skipped
    if not rows:
        return [], f"eagle3 eval did not measure {method} (evaluate.chain_steps / tree_* settings)"
    counts = {d: r["num_prompts"] for d, r in rows.items() if d != "all" and "num_prompts" in r}
    other = prompt_count_mismatch(counts, run.groups) if counts else None  # results older than the count: unchecked
    if other:
        return [], other
    checks = []
    for dataset, ours in sglang_accept_lengths(run):
        if dataset in rows:
            theirs = rows[dataset]["num_tokens"] / rows[dataset]["num_verify"]
            gap = abs(ours - theirs) / theirs
            checks.append(AcceptCheck(run.trio, dataset, ours, theirs, gap, gap <= cfg.serve.accept_tolerance))
    return checks, None


def prompt_count_mismatch(evaluated: Mapping[str, int], groups: Sequence[str]) -> str | None:
    """Why eagle3 eval measured other prompts than the servers were sent (prompts per dataset differ, e.g. an
    evaluation of a subset), or None. Both take the first prompts of each dataset, so equal counts are equal sets."""
    sent = Counter(groups)
    for dataset in sorted(set(evaluated) | set(sent)):
        if evaluated.get(dataset, 0) != sent.get(dataset, 0):
            return (
                f"eagle3 eval measured {evaluated.get(dataset, 0)} {dataset} prompts, the servers were sent "
                f"{sent.get(dataset, 0)}: evaluate the same prompts (evaluate.num_prompts, num_prompts_by_dataset)"
            )
    return None


def eval_rows(cfg: RunConfig, method: str) -> tuple[dict[str, dict[str, Any]], str | None]:
    """eagle3 eval's results.json rows of ``method`` by dataset, on the prompts the servers were sent, or why there
    are none to compare with (then the rows are empty)."""
    from eagle3.run.layout import run_layout

    if cfg.serve.prompts != "evaluation":
        return {}, "serve.prompts is fixed: eagle3 eval measured other prompts"
    path = run_layout(cfg).eval_results
    if not path.is_file():
        return {}, f"no {path}: run the evaluate step first"
    doc = json.loads(path.read_text())
    if doc.get("settings", {}).get("max_new_tokens") != cfg.serve.max_new_tokens:
        return {}, (
            f"eagle3 eval generated {doc.get('settings', {}).get('max_new_tokens')} tokens per prompt, "
            f"the servers {cfg.serve.max_new_tokens}: set evaluate.max_new_tokens equal"
        )
    other = sampling_mismatch(cfg, doc.get("settings", {}).get("evaluate", {}))
    if other:
        return {}, other
    return {r["dataset"]: r for r in doc.get("results", []) if r.get("method") == method}, None


def sampling_mismatch(cfg: RunConfig, evaluated: Mapping[str, Any]) -> str | None:
    """Why eagle3 eval's results (its evaluate settings, ``evaluated``) sampled otherwise than the servers were
    asked to (temperature, top_p, top_k, and at temperature > 0 the chain rule), or None."""
    from eagle3.config import EvaluateConfig

    fields = EvaluateConfig.model_fields
    names = [n for n in SAMPLING_FIELDS if n != "chain_sampling" or cfg.evaluate.temperature > 0]
    for name in names:
        ran, asked = evaluated.get(name, fields[name].default), getattr(cfg.evaluate, name)
        if ran != asked:
            return (
                f"eagle3 eval ran with evaluate.{name}={ran!r}, the servers with {asked!r}: "
                "evaluate again with these settings"
            )
    return None


def sglang_accept_lengths(run: ServerRun) -> list[tuple[str, float]]:
    """(dataset, tokens / verify steps) per dataset and overall at the lowest concurrency (datasets without a verify
    step left out)."""
    from infra.sglang_compare import group_indices

    level = min(run.result.levels, key=lambda lv: lv.concurrency)
    out = []
    for dataset, idx in group_indices(run.groups):
        verify = sum(level.verify_by_prompt[i] for i in idx)
        if verify:
            out.append((dataset, sum(level.completion_by_prompt[i] for i in idx) / verify))
    return out


@dataclass(frozen=True)
class SameTextCheck:
    """Accept lengths on the prompts whose greedy output is identical in SGLang and eagle3 eval, for one dataset."""

    trio: str
    dataset: str
    num_same: int  # prompts whose outputs are token-identical
    num_prompts: int
    sglang: float  # tokens / SGLang's verify steps on those prompts (the same tokens on both sides)
    evaluate: float  # tokens / eagle3 eval's verify steps on those prompts
    rel_diff: float
    ok: bool


def eval_records(cfg: RunConfig) -> dict[int, PromptRecord] | None:
    """eval/prompts.jsonl by prompt index (None when the evaluation wrote none)."""
    from eagle3.evaluate.records import PromptRecord
    from eagle3.run.layout import PROMPTS_FILE, run_layout

    path = run_layout(cfg).eval / PROMPTS_FILE
    if not path.is_file():
        return None
    records = (PromptRecord.from_json(json.loads(line)) for line in path.read_text().split("\n") if line.strip())
    return {r.index: r for r in records}


def same_output(sglang_digest: str, ours: list[int]) -> bool:
    """SGLang's output (by digest) is ours, with or without the end-of-turn token (engines differ on keeping it)."""
    from infra.sglang_bench import output_digest

    return sglang_digest in (output_digest(ours), output_digest(ours[:-1]) if ours else "")


def same_text_checks(cfg: RunConfig, run: ServerRun) -> tuple[list[SameTextCheck], str | None]:
    """Per dataset and overall: verify steps on token-identical outputs; (checks, why none were made)."""
    from infra.sglang_compare import group_indices

    if cfg.evaluate.temperature > 0:
        return [], "requests sampled: outputs are identical only by chance, so no text is shared to compare on"
    records = eval_records(cfg)
    if records is None or cfg.serve.prompts != "evaluation" or run.trio is None:
        return [], "no eval/prompts.jsonl with this drafting to compare per prompt"
    other = prompt_count_mismatch(Counter(r.dataset for r in records.values()), run.groups)
    if other:  # prompts are paired by index: another prompt set would pair the wrong ones
        return [], other
    method = eval_method_name(run.trio, cfg.drafter.family)
    level: LevelResult = min(run.result.levels, key=lambda lv: lv.concurrency)
    same: dict[int, tuple[int, int, int]] = {}  # prompt -> (tokens, SGLang verify steps, eval verify steps)
    for i in range(len(run.groups)):
        rec = records.get(i)
        m = rec.methods.get(method) if rec else None
        if rec is None or m is None or i >= len(level.output_digests):
            continue
        ours = m.tokens if m.tokens is not None else rec.greedy.tokens
        if same_output(level.output_digests[i], ours):
            same[i] = (m.num_tokens, level.verify_by_prompt[i], len(m.committed))
    if not same:
        return [], f"no prompt's output is identical in SGLang and eagle3 eval ({method})"
    checks = []
    for dataset, idx in group_indices(run.groups):
        hits = [same[i] for i in idx if i in same]
        tokens, sglang_verify, eval_verify = (sum(h[k] for h in hits) for k in range(3))
        if not hits or not sglang_verify or not eval_verify:
            continue
        a, b = tokens / sglang_verify, tokens / eval_verify
        gap = abs(a - b) / b
        checks.append(
            SameTextCheck(run.trio, dataset, len(hits), len(idx), a, b, gap, gap <= cfg.serve.accept_tolerance)
        )
    return checks, None


def render_checks(checks: list[AcceptCheck], same: list[SameTextCheck], same_skipped: str | None) -> str:
    """The report's parity table: every prompt, and the prompts with identical outputs."""
    by_dataset = {c.dataset: c for c in same}
    lines = [
        "",
        "| dataset | SGLang accept length | eagle3 eval | gap | identical outputs | SGLang / eval on them | gap |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in checks:
        s = by_dataset.get(c.dataset)
        on_same = (
            (
                f"{s.num_same}/{s.num_prompts} | {s.sglang:.3f} / {s.evaluate:.3f} | "
                f"{100 * s.rel_diff:.1f}%{'' if s.ok else ' FAIL'}"
            )
            if s
            else "0 | - | -"
        )
        lines.append(
            f"| {c.dataset} | {c.sglang:.3f} | {c.evaluate:.3f} | {100 * c.rel_diff:.1f}%"
            f"{'' if c.ok else ' FAIL'} | {on_same} |"
        )
    if same_skipped:
        lines.append(f"\nIdentical outputs not compared: {same_skipped}")
    return "\n".join(lines) + "\n"


def check_errors(checks: list[AcceptCheck], same: list[SameTextCheck], tolerance: float) -> list[str]:
    """One line per failed check, the same-text figure beside a whole-set failure (it says where the gap is)."""
    by_dataset = {c.dataset: c for c in same}
    errors = []
    for c in checks:
        if c.ok:
            continue
        s = by_dataset.get(c.dataset)
        head = (
            f"{c.trio} {c.dataset}: SGLang accept length {c.sglang:.3f} vs eagle3 eval {c.evaluate:.3f} "
            f"({100 * c.rel_diff:.1f}% > {100 * tolerance:.0f}%)"
        )
        if s and s.ok:  # the same text drafts alike: the whole-set gap is other text, not another drafter
            errors.append(
                f"{head}; on the {s.num_same} prompts with identical outputs the gap is {100 * s.rel_diff:.1f}%, "
                "so it comes from outputs that diverged (other text drafted), not from the drafter or a "
                "train/serve mismatch"
            )
        else:
            where = (
                f"; on the {s.num_same} prompts with identical outputs the gap is {100 * s.rel_diff:.1f}%" if s else ""
            )
            errors.append(f"{head}: {MISMATCH_HINT}{where}")
    errors += [
        f"{s.trio} {s.dataset}: on {s.num_same} prompts with identical outputs SGLang's accept length "
        f"{s.sglang:.3f} vs eagle3 eval {s.evaluate:.3f} ({100 * s.rel_diff:.1f}% > {100 * tolerance:.0f}%): "
        f"{MISMATCH_HINT}"
        for s in same
        if not s.ok
    ]
    return errors


# ------------------------------------------------------------------------ SGLang's n-gram beside eagle3 eval's

NGRAM = "ngram"
"""The n-gram server's setting (a ServerRun's ``trio``) and the name of eagle3 eval's n-gram method."""
NGRAM_LABEL = "n-gram"


@dataclass(frozen=True)
class NgramBeside:
    """SGLang's n-gram accept length beside eagle3 eval's n-gram method for one dataset: two implementations of
    drafter-free drafting, shown side by side and never checked against each other."""

    dataset: str
    sglang: float
    evaluate: float


def ngram_beside_eval(cfg: RunConfig, run: ServerRun) -> tuple[list[NgramBeside], str | None]:
    """Per dataset and overall, at the lowest concurrency: (rows, why there are none)."""
    rows, skipped = eval_rows(cfg, NGRAM)
    if skipped:
        return [], skipped
    if not rows:
        return [], "eagle3 eval did not measure its n-gram method (evaluate.methods)"
    return [
        NgramBeside(dataset, ours, rows[dataset]["num_tokens"] / rows[dataset]["num_verify"])
        for dataset, ours in sglang_accept_lengths(run)
        if dataset in rows
    ], None


def render_ngram_beside(rows: list[NgramBeside], skipped: str | None) -> str:
    """The report's n-gram lines: SGLang's accept length beside eagle3 eval's, labelled as another implementation."""
    if not rows:
        return f"\nAccept length not shown beside eagle3 eval's n-gram: {skipped}\n"
    lines = [
        "",
        "Beside eagle3 eval's n-gram method, a different implementation (SGLang's NGRAM drafts a tree from a "
        "trie of recent tokens that all requests share; eagle3 eval's looks up the request's own context and "
        "drafts a chain): accept lengths shown, not checked.",
        "",
        "| dataset | SGLang NGRAM accept length | eagle3 eval n-gram (other implementation) |",
        "|---|---:|---:|",
    ]
    lines += [f"| {r.dataset} | {r.sglang:.3f} | {r.evaluate:.3f} |" for r in rows]
    return "\n".join(lines) + "\n"
