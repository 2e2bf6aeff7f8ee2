"""Issue 42's goal measured: the half, refreshed and full drafters on the refresh gate's frozen prompts, then the
recovered share and the training shares against the goal (lab/refresh_goal.py measure).

Each drafter goes through the gate's own measurement (eagle3.refresh.gate.measure: chain refresh.gate.chain_steps,
top-k 1, the run's evaluate settings, every output checked against plain greedy decoding), one after the other in
this process, each journaled in goal/measure/<role>.journal.jsonl under a key of its weights, the settings and the
prompts. With ``reuse_gate``, the half and refreshed drafters' journals start as copies of the gate's (the
promoted drafter, i.e. the half run's export, and the candidate): prompts journaled there under the same key were
measured by the same function in the refresh's process and are not decoded again; ``measured_here`` says how many
each drafter decoded in this process.

    recovered share = (refreshed - half) / (full - half), acceptance length over all prompts; >= RECOVERED_MIN
    time share      = the candidate's training seconds / the full run's (lab/refresh_goal_budget.py); <= SHARE_MAX
    tokens share    = the candidate's training tokens / the full run's (what the step budget aimed at)
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab.refresh_goal_budget import Training

if TYPE_CHECKING:
    from eagle3.config import RunConfig
    from eagle3.evaluate.records import PromptRecord
    from eagle3.refresh.gate import GatePrompt

ROLES = ("half", "refreshed", "full")
GATE_ROLES = {"half": "current", "refreshed": "candidate"}
"""The gate's name for the drafters it measured: the promoted one (the half run's export) and the candidate."""
RECOVERED_MIN, SHARE_MAX = 0.70, 0.30
"""Issue 42: recover >= 70% of the acceptance gap at <= 30% of the full-data drafter's training time."""


def _lines(path: Path) -> int:
    """Lines of a journal (0 when absent)."""
    return len(path.read_bytes().splitlines()) if path.is_file() else 0


def measure_drafters(
    cfg: RunConfig, prompts: list[GatePrompt], exports: dict[str, Path], journals: Path, gate_dir: Path | None
) -> tuple[dict[str, list[PromptRecord]], dict[str, int]]:
    """Each role's records on ``prompts`` and how many prompts it decoded here; ``gate_dir``: reuse its journals."""
    from eagle3.refresh.gate import JOURNAL_FILES, measure
    from eagle3.run.journal import Journal
    from eagle3.target.load import prepare_target

    model_dir = prepare_target(cfg)
    records: dict[str, list[PromptRecord]] = {}
    here: dict[str, int] = {}
    for role in ROLES:
        journal = journals / f"{role}.journal.jsonl"
        seed = gate_dir / JOURNAL_FILES[GATE_ROLES[role]] if gate_dir is not None and role in GATE_ROLES else None
        if seed is not None and seed.is_file() and not journal.exists():
            journal.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(seed, journal)
        before = _lines(journal)
        records[role] = measure(cfg, model_dir, prompts, exports[role], Journal(journal))
        here[role] = _lines(journal) - before
    return records, here


def group_rows(prompts: list[GatePrompt], records: dict[str, list[PromptRecord]], method: str) -> list[dict]:
    """Acceptance length of each role per group (all, each dataset, each dataset/category), in prompt order."""
    from eagle3.evaluate.report import summarize

    groups: dict[str, list[int]] = {}
    for index, prompt in enumerate(prompts):
        for group in prompt.groups():
            groups.setdefault(group, []).append(index)
    return [
        {"group": group, "prompts": len(idx)}
        | {role: summarize([records[role][i] for i in idx], method, group).accept_len for role in ROLES}
        for group, idx in groups.items()
    ]


def recovered(row: dict[str, Any]) -> float | None:
    """(refreshed - half) / (full - half); None when the full drafter does not beat the half one."""
    gap = row["full"] - row["half"]
    return (row["refreshed"] - row["half"]) / gap if gap > 0 else None


def verdict(share: float | None, passes: bool) -> str:
    """PASS / FAIL (FAIL when the share is undefined)."""
    return "PASS" if share is not None and passes else "FAIL"


def goal_doc(rows: list[dict], trainings: dict[str, Training], mismatches: dict[str, int]) -> dict[str, Any]:
    """goal.json's figures and verdicts (the caller adds what was measured where, and the runs' timings)."""
    overall = next(r for r in rows if r["group"] == "all")
    share = recovered(overall)
    cand, full = trainings["refreshed"], trainings["full"]
    time_share, tokens_share = cand.steps_s / full.steps_s, cand.tokens / full.tokens
    return {
        "accept_len": {role: overall[role] for role in ROLES},
        "recovered_share": share,
        "time_share": time_share,
        "tokens_share": tokens_share,
        "training": {role: t.to_json() for role, t in trainings.items()},
        "mismatches": mismatches,
        "groups": [r | {"recovered": recovered(r)} for r in rows],
        "verdict": {
            "recovered": verdict(share, share is not None and share >= RECOVERED_MIN),
            "time": verdict(time_share, time_share <= SHARE_MAX),
            "goal": verdict(share, share is not None and share >= RECOVERED_MIN and time_share <= SHARE_MAX),
        },
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def goal_markdown(doc: dict[str, Any]) -> str:
    """The table and the verdicts (goal.md, printed)."""
    a, v = doc["accept_len"], doc["verdict"]
    t = {role: doc["training"][role] for role in ("refreshed", "full")}
    lines = [
        f"Acceptance length, {doc['method']} on {doc['prompts']['count']} frozen prompts "
        f"({doc['prompts']['file']}, sha256 {doc['prompts']['sha256'][:12]}); decoded here: {doc['measured_here']}",
        "",
        "| group | prompts | half | refreshed | full | recovered |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['group']} | {r['prompts']} | {r['half']:.3f} | {r['refreshed']:.3f} | {r['full']:.3f} | "
            f"{_pct(r['recovered'])} |"
            for r in doc["groups"]
        ),
        "",
        f"recovered share: ({a['refreshed']:.3f} - {a['half']:.3f}) / ({a['full']:.3f} - {a['half']:.3f}) = "
        f"{_pct(doc['recovered_share'])} (goal >= {RECOVERED_MIN:.0%}): {v['recovered']}",
        f"time share: the candidate's {t['refreshed']['steps']:,} steps took {t['refreshed']['steps_s']:,.1f} s / "
        f"the full run's {t['full']['steps']:,} steps {t['full']['steps_s']:,.1f} s = {_pct(doc['time_share'])} "
        f"(goal <= {SHARE_MAX:.0%}): {v['time']}",
        f"tokens share: {t['refreshed']['tokens']:,} / {t['full']['tokens']:,} = {_pct(doc['tokens_share'])} "
        f"(the step budget's aim, {doc['budget']['by']} {doc['budget']['share']:g})",
        f"lossless mismatches against greedy: {doc['mismatches']}",
        f"wall clock: half run's train {doc['walls'].get('base train s', '-')} s; the whole refresh "
        f"(ingest, data, train, export, gate) {doc['walls'].get('refresh s', '-')} s",
        f"goal: {v['goal']}",
    ]
    return "\n".join(lines) + "\n"
