"""The promotion gate: the promoted drafter and the candidate measured on one frozen prompt file, in one process,
with the same target, settings and chain; the candidate is promoted only if it is better overall by a margin and no
group of prompts loses more than a tolerance.

Prompt file (JSONL, one ``{"id", "dataset", "category", "text"}`` a line): ``refresh.gate.prompts``, or, unset, the
evaluation prompts the run's evaluate section names (first N per dataset in file order, MT-Bench with its question
categories), written once to ``<run>/refresh/gate_prompts.jsonl`` at the first refresh and read as it is ever after,
so every round is judged on the same prompts. Groups: every prompt (``all``), each dataset, each dataset/category.

Rule (``decide``), in this order: a candidate whose output differs from plain greedy decoding on any prompt is never
promoted (a lossless check failing is a bug); then acceptance length over all prompts must rise by at least
``refresh.gate.min_gain``; then no group may fall by more than ``refresh.gate.max_drop``. Acceptance length is
tokens committed per target verify forward, bonus included (eagle3.evaluate).

Each drafter's prompts are journaled as they finish (``gate/<role>.journal.jsonl``, keyed by the drafter's weights,
the prompt file and the settings), and the result is saved as ``gate/gate.json``, so a killed refresh measures
only what is missing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3.run.journal import Journal
from infra.storage import atomic_write_json, atomic_write_text, sha256_file, sha256_json

if TYPE_CHECKING:
    from eagle3.config import RunConfig
    from eagle3.config_refresh import GateConfig
    from eagle3.evaluate.prompts import EvalPrompt
    from eagle3.evaluate.records import PromptRecord

GATE_PROMPTS_FILE, GATE_FILE, GATE_DIR = "gate_prompts.jsonl", "gate.json", "gate"  # GATE_DIR: in rounds/<N>/
JOURNAL_FILES = {"current": "current.journal.jsonl", "candidate": "candidate.journal.jsonl"}
"""gate/: each drafter's per-prompt records as they finish (keyed by its weights, the prompt file and the settings)."""
ALL = "all"


class GatePromptError(ValueError):
    """A gate prompt file that cannot be used (a line that is not a prompt record, no prompts)."""


@dataclass(frozen=True)
class GatePrompt:
    """One line of the gate prompt file."""

    id: str
    dataset: str
    category: str | None
    text: str

    def groups(self) -> list[str]:
        """The groups the prompt counts in: all, its dataset, its dataset/category."""
        return [ALL, self.dataset] + ([f"{self.dataset}/{self.category}"] if self.category else [])


@dataclass(frozen=True)
class GateRow:
    """One group: acceptance length of the promoted drafter and of the candidate on its prompts."""

    group: str
    num_prompts: int
    current: float
    candidate: float

    @property
    def delta(self) -> float:
        """candidate - current."""
        return self.candidate - self.current


@dataclass(frozen=True)
class GateResult:
    """gate.json: the table, the verdict and what it was measured on."""

    promote: bool
    reason: str
    method: str
    rows: list[GateRow]
    current: str  # the promoted drafter's id
    prompts_sha256: str
    candidate_mismatches: int

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> GateResult:
        """The result ``to_json`` wrote."""
        return cls(**{**doc, "rows": [GateRow(**r) for r in doc["rows"]]})

    def table(self) -> list[dict[str, Any]]:
        """The rows as plain dicts with the delta (promotion records, reports)."""
        return [asdict(r) | {"delta": r.delta} for r in self.rows]


# ------------------------------------------------------------------------------------------ the prompt file


def mtbench_categories() -> dict[str, str]:
    """MT-Bench prompt id -> its question category, from the installed question file."""
    from eagle3.evaluate.prompts import dataset_file

    categories = {}
    for line in dataset_file("mtbench").read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            categories[f"mtbench:{record['question_id']}"] = str(record.get("category") or "") or None
    return {k: v for k, v in categories.items() if v}


def freeze_prompts(cfg: RunConfig, path: Path) -> Path:
    """Write the evaluate section's prompts, with MT-Bench categories, to ``path`` (once: an existing file is kept)."""
    from eagle3.evaluate.prompts import read_prompts

    if path.is_file():
        return path
    e = cfg.evaluate
    categories = mtbench_categories() if "mtbench" in e.datasets else {}
    lines = [
        json.dumps(
            {"id": p.id, "dataset": p.dataset, "category": categories.get(p.id), "text": p.text}, ensure_ascii=False
        )
        for name in e.datasets
        for p in read_prompts(name, e.limit_for(name))
    ]
    return atomic_write_text(path, "\n".join(lines) + "\n")


def read_gate_prompts(path: Path) -> list[GatePrompt]:
    """The prompts of a gate prompt file; GatePromptError naming the line of a bad one."""
    prompts = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            prompts.append(
                GatePrompt(str(doc["id"]), str(doc["dataset"]), doc.get("category") or None, str(doc["text"]))
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise GatePromptError(
                f"{path}:{number}: not a gate prompt record ({type(exc).__name__}: {exc}); "
                'expected {"id", "dataset", "category", "text"}'
            ) from None
    if not prompts:
        raise GatePromptError(f"{path} holds no prompts")
    return prompts


# ---------------------------------------------------------------------------------------------- measuring


def method_name(steps: int) -> str:
    """The evaluate method the gate measures: a chain of ``steps`` drafts, topk 1."""
    return f"chain-{steps}-1-{steps + 1}"


def _job(
    cfg: RunConfig,
    model_dir: Path,
    export_dir: Path,
    items: list[tuple[EvalPrompt, list[int]]],
    stop_ids: list[int],
    device: str,
):
    from eagle3.evaluate.session import EvalJob

    e = cfg.evaluate.resolved(device).model_copy(
        update={"methods": ["chain"], "chain_steps": [cfg.refresh.gate.chain_steps]}
    )
    cache_len = max(len(ids) for _, ids in items) + e.max_new_tokens + 128  # + verify and draft rows
    return EvalJob(str(model_dir), str(export_dir), e.model_dump(mode="json"), device, stop_ids, None, cache_len)


def measure(
    cfg: RunConfig, model_dir: Path, prompts: list[GatePrompt], export_dir: Path, journal: Journal
) -> list[PromptRecord]:
    """One drafter's records on the gate prompts (this process; prompts already journaled are not measured again)."""
    from eagle3.evaluate.pool import evaluate_prompts
    from eagle3.evaluate.prompts import EvalPrompt, render
    from eagle3.evaluate.stage import resolve_device
    from eagle3.export.checks import WEIGHTS_FILE
    from eagle3.target.load import load_tokenizer, stop_token_ids, target_info

    tokenizer = load_tokenizer(model_dir)
    items = [(EvalPrompt(p.dataset, p.id, p.text), render(tokenizer, p.text)) for p in prompts]
    job = _job(
        cfg,
        model_dir,
        export_dir,
        items,
        stop_token_ids(tokenizer, target_info(model_dir, cfg.target)),
        resolve_device(cfg.evaluate.device),
    )
    settings = {k: v for k, v in asdict(job).items() if k not in ("model_dir", "export_dir")}  # not where: what
    key = sha256_json(
        {"weights": sha256_file(Path(export_dir) / WEIGHTS_FILE), "job": settings, "prompts": [p.id for p in prompts]}
    )
    return evaluate_prompts(job, items, 1, journal=journal, key=key)


def rows_of(
    prompts: list[GatePrompt], current: list[PromptRecord], candidate: list[PromptRecord], method: str
) -> list[GateRow]:
    """One row per group (all first, then datasets and categories in prompt order)."""
    from eagle3.evaluate.report import summarize

    groups: dict[str, list[int]] = {}
    for index, prompt in enumerate(prompts):
        for group in prompt.groups():
            groups.setdefault(group, []).append(index)
    return [
        GateRow(
            group,
            len(idx),
            summarize([current[i] for i in idx], method, group).accept_len,
            summarize([candidate[i] for i in idx], method, group).accept_len,
        )
        for group, idx in groups.items()
    ]


def decide(rows: list[GateRow], gate: GateConfig, mismatches: int) -> tuple[bool, str]:
    """(promote, why): the rule of the module docstring."""
    overall = next(r for r in rows if r.group == ALL)
    if mismatches:
        return False, (
            f"kept: the candidate's output differs from plain greedy decoding on {mismatches} prompt(s) "
            "(a lossless check failed: a bug, never promoted)"
        )
    if overall.delta < gate.min_gain:
        return False, (
            f"kept: overall acceptance length {overall.current:.3f} -> {overall.candidate:.3f} "
            f"({overall.delta:+.3f}) rises by less than refresh.gate.min_gain={gate.min_gain}"
        )
    dropped = [r for r in rows if r.group != ALL and -r.delta > gate.max_drop]
    if dropped:
        names = ", ".join(f"{r.group} {r.current:.3f} -> {r.candidate:.3f} ({r.delta:+.3f})" for r in dropped)
        return False, f"kept: {names} fell by more than refresh.gate.max_drop={gate.max_drop}"
    return True, (
        f"promoted: overall acceptance length {overall.current:.3f} -> {overall.candidate:.3f} "
        f"({overall.delta:+.3f} >= {gate.min_gain}); no group fell by more than {gate.max_drop}"
    )


def run_gate(
    cfg: RunConfig, model_dir: Path, prompts_path: Path, current: tuple[str, Path], candidate: Path, gate_dir: Path
) -> GateResult:
    """Measure ``current`` (id, folder) and ``candidate`` on the prompt file and decide; saved as gate/gate.json,
    which a later call returns as it is while it judged the same drafter on the same prompts."""
    saved = gate_dir / GATE_FILE
    prompts_sha = sha256_file(prompts_path)
    if saved.is_file():
        result = GateResult.from_json(json.loads(saved.read_text()))
        if (result.current, result.prompts_sha256) == (current[0], prompts_sha):
            return result
    prompts = read_gate_prompts(prompts_path)
    method = method_name(cfg.refresh.gate.chain_steps)
    ours = measure(cfg, model_dir, prompts, current[1], Journal(gate_dir / JOURNAL_FILES["current"]))
    theirs = measure(cfg, model_dir, prompts, candidate, Journal(gate_dir / JOURNAL_FILES["candidate"]))
    rows = rows_of(prompts, ours, theirs, method)
    mismatches = sum(r.methods[method].lossless.kind == "mismatch" for r in theirs)
    promote, reason = decide(rows, cfg.refresh.gate, mismatches)
    result = GateResult(promote, reason, method, rows, current[0], prompts_sha, mismatches)
    atomic_write_json(saved, result.to_json())
    return result
