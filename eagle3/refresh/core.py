"""One refresh of a run, without Prefect: lock, new prompts, their answers, a warm-started candidate, the gate, the
promotion or the reason it was kept, and the report.

    python -m eagle3.refresh --preset smollm2-demo --set refresh.prompts=/data/traffic/

Order, and what a kill at any point leaves (every step skips what it finds complete):
 1. The run lock (``<run>/.lock``): a second refresh, a pipeline run or a promotion of the same run fails at once
    naming the holder.
 2. A promoted drafter: the first refresh promotes the run's own export (kind ``initial``).
 3. A round: the last round taken but not decided resumes; else the lines past the watermark become the next
    round's prompts.jsonl, then its watermark record (eagle3.refresh.source). No new line: nothing else happens.
 4. The round's prompts merged and answered (ingest/), the pool merged and a candidate trained from the promoted
    drafter (candidate/), both measured by the gate (gate/gate.json).
 5. A candidate that passed is promoted (eagle3.refresh.line: the drafter folder, then the ``current`` pointer).
 6. report.md, then the round's decision record (``refresh/decisions.jsonl``): the round is closed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3.refresh.line import PROMOTION_FILE, Line, PromotionError, utc_now
from eagle3.refresh.records import Promotion, RefreshOutcome
from eagle3.refresh.report import refresh_markdown
from eagle3.refresh.source import PromptSource, to_record
from eagle3.run.journal import Journal
from infra.storage import atomic_write_bytes, atomic_write_text, run_lock, sha256_file, sha256_file_cached

if TYPE_CHECKING:
    from eagle3.config import RunConfig
    from eagle3.refresh.gate import GateResult

REFRESH_DIR, ROUNDS_DIR = "refresh", "rounds"
WATERMARK_FILE, DECISIONS_FILE, REPORT_FILE = "watermark.jsonl", "decisions.jsonl", "report.md"
START_FILE = "start.json"  # rounds/<N>/: the drafter the candidate trains from
NO_NEW = "no new prompts"


class RefreshConfigError(ValueError):
    """A run that cannot be refreshed as configured."""


def refresh_dir(cfg: RunConfig) -> Path:
    """<run>/refresh."""
    return cfg.run_dir / REFRESH_DIR


def round_dir(cfg: RunConfig, round_id: str) -> Path:
    """<run>/refresh/rounds/<id>."""
    return refresh_dir(cfg) / ROUNDS_DIR / round_id


def prompt_source(cfg: RunConfig) -> PromptSource:
    """refresh.prompts behind <run>/refresh/watermark.jsonl."""
    from eagle3.run.paths import resolve_path

    if cfg.refresh.prompts is None:
        raise RefreshConfigError(
            "refresh.prompts is not set: name the folder or JSONL file of new prompts (--set refresh.prompts=PATH)"
        )
    return PromptSource(resolve_path(cfg.refresh.prompts), refresh_dir(cfg) / WATERMARK_FILE)


def run_refresh(cfg: RunConfig, owner: str = "python -m eagle3.refresh") -> RefreshOutcome:
    """One refresh of ``cfg``'s run (module docstring)."""
    if cfg.drafter.family != "eagle3":
        raise RefreshConfigError(f"refresh warm-starts EAGLE-3 drafters only, not drafter.family={cfg.drafter.family}")
    source = prompt_source(cfg)
    with run_lock(cfg.run_dir, owner=owner):
        line = Line(cfg.run_dir)
        ensure_current(cfg, line)
        decisions = Journal(refresh_dir(cfg) / DECISIONS_FILE)
        round_id = open_round(source, decisions) or take_round(cfg, source)
        if round_id is None:
            return RefreshOutcome(
                cfg.run.name,
                NO_NEW,
                f"no complete line past the watermark in {source.source}",
                line.current_id(),
                str(source.source),
            )
        return finish_round(cfg, line, source, decisions, round_id)


def ensure_current(cfg: RunConfig, line: Line) -> None:
    """Promote the run's own export when nothing is promoted yet; repair the events and card of the current one."""
    if line.current_id() is None:
        promote_export(
            cfg,
            line,
            "initial",
            "the run's own export, promoted by the first refresh (no gate: nothing was promoted to compare it with)",
        )
    line.record_current()


def promote_export(cfg: RunConfig, line: Line, kind: str, reason: str) -> Promotion:
    """Promote <run>/export/sglang without a gate (the first refresh, ``eagle3 promote``); its promotion."""
    from eagle3.export import stage as export_stage
    from eagle3.export.checks import WEIGHTS_FILE
    from eagle3.export.model_card import CARD_FILE
    from eagle3.refresh.candidate import answered_file
    from eagle3.run.layout import run_layout, run_relative

    layout = run_layout(cfg)
    export = layout.sglang_export
    if not export_stage.STAGE.manifest(layout.root).is_file() or not (export / WEIGHTS_FILE).is_file():
        raise PromotionError(
            f"{cfg.run_dir} has no complete export to promote: run the pipeline up to export first "
            f"(eagle3 run --preset ... --until export)"
        )
    weights = sha256_file(export / WEIGHTS_FILE)
    data = answered_file(cfg)
    promotion = Promotion(
        f"run-{weights[:12]}",
        kind,
        line.current_id(),
        reason,
        utc_now(),
        run_relative(cfg.run_dir, export),
        [],
        {"weights": weights, "run data": sha256_file_cached(data) if data.is_file() else None},
    )
    if promotion.id == line.current_id():
        raise PromotionError(f"the run's export is the current drafter already ({promotion.id})")
    card = export / CARD_FILE
    line.promote(export, promotion, card.read_text() if card.is_file() else "")
    return promotion


def open_round(source: PromptSource, decisions: Journal) -> str | None:
    """The last round taken but not decided (a killed refresh), or None."""
    records = source.records()
    if records and records[-1]["id"] not in decisions.load():
        return str(records[-1]["id"])
    return None


def take_round(cfg: RunConfig, source: PromptSource) -> str | None:
    """Write the lines past the watermark as the next round's prompts.jsonl, then record the watermark; its id, or
    None when there is no new line."""
    from eagle3.refresh.candidate import PROMPTS

    new = source.read_new(cfg.refresh.max_prompts)
    if not new.spans:
        return None
    round_id = f"{len(source.records()) + 1:04d}"
    lines = [to_record(line, cfg.refresh.regenerate) for line in new.lines]
    batch = atomic_write_bytes(round_dir(cfg, round_id) / PROMPTS, b"".join(x + b"\n" for x in lines))
    source.commit(round_id, new, sha256_file(batch))
    return round_id


def finish_round(cfg: RunConfig, line: Line, source: PromptSource, decisions: Journal, round_id: str) -> RefreshOutcome:
    """Ingest, candidate, gate, promotion, report and decision of a round taken from the source."""
    from eagle3.refresh.candidate import build_candidate, candidate_config, ingest, pool_sources

    record = next(r for r in source.records() if r["id"] == round_id)
    where = round_dir(cfg, round_id)
    outcome = RefreshOutcome(
        cfg.run.name, "kept", "", line.current_id(), str(source.source), round_id, record["num_lines"], record["spans"]
    )
    answered = ingest(cfg, where) if record["num_lines"] else None
    outcome.ingest = ingest_summary(cfg, where)
    if answered is None:
        outcome.reason = (
            f"kept: none of the {record['num_lines']} new line(s) is a usable conversation (reasons: "
            f"{where / 'ingest' / 'data' / 'rejects.jsonl'})"
        )
        return close_round(cfg, line, decisions, outcome, None)
    pool = [*earlier_answers(cfg, decisions), (round_id, answered)]
    cand = candidate_config(cfg, where, pool_sources(cfg, pool), start_drafter(line, where))
    export_dir = build_candidate(cand)
    outcome.train = train_summary(cand)
    current_id, current_dir = line.current_id(), line.current_dir()
    assert current_id is not None and current_dir is not None  # (ensure_current promoted one)
    gate = judge(cfg, line, where, (current_id, current_dir), export_dir)
    outcome.gate, outcome.gate_table, outcome.gate_prompts = gate.to_json(), gate.table(), str(gate_prompts_path(cfg))
    outcome.status, outcome.reason = ("promoted" if gate.promote else "kept"), gate.reason
    if gate.promote:
        promote_candidate(cfg, line, round_id, export_dir, gate, pool)
    return close_round(cfg, line, decisions, outcome, answered)


def start_drafter(line: Line, where: Path) -> Path:
    """The drafter the round's candidate trains from: the one current when the round first got here, kept in
    start.json (a resumed round must not start from another, its own promoted candidate included)."""
    import json

    from infra.storage import atomic_write_json

    path = where / START_FILE
    if not path.is_file():
        atomic_write_json(path, {"drafter": line.current_id()})
    return line.drafter_dir(json.loads(path.read_text())["drafter"])


def judge(cfg: RunConfig, line: Line, where: Path, current: tuple[str, Path], export_dir: Path) -> GateResult:
    """The round's gate result: the saved one when a killed refresh already promoted this round's candidate, else
    measured now (eagle3.refresh.gate.run_gate)."""
    import json

    from eagle3.refresh.gate import GATE_DIR, GATE_FILE, GateResult, freeze_prompts, run_gate
    from eagle3.target.load import prepare_target

    if (line.drafter_dir(f"round-{where.name}") / PROMOTION_FILE).is_file():
        return GateResult.from_json(json.loads((where / GATE_DIR / GATE_FILE).read_text()))
    prompts = gate_prompts_path(cfg)
    if cfg.refresh.gate.prompts is None:
        freeze_prompts(cfg, prompts)
    return run_gate(cfg, prepare_target(cfg), prompts, current, export_dir, where / GATE_DIR)


def gate_prompts_path(cfg: RunConfig) -> Path:
    """refresh.gate.prompts, or the prompt file frozen at the first refresh."""
    from eagle3.refresh.gate import GATE_PROMPTS_FILE
    from eagle3.run.paths import resolve_path

    return resolve_path(cfg.refresh.gate.prompts) if cfg.refresh.gate.prompts else refresh_dir(cfg) / GATE_PROMPTS_FILE


def promote_candidate(
    cfg: RunConfig, line: Line, round_id: str, export_dir: Path, gate: GateResult, pool: list[tuple[str, Path]]
) -> None:
    """Publish the candidate as drafter round-<id> and point ``current`` at it (unless a killed refresh did, and a
    rollback has undone it since)."""
    from eagle3.export.model_card import CARD_FILE
    from eagle3.refresh.candidate import answered_file
    from eagle3.run.layout import run_relative

    drafter = f"round-{round_id}"
    if f"promote-{drafter}" in line.events.load():
        return
    digests = {
        "run data": sha256_file_cached(answered_file(cfg)),
        "gate prompts": gate.prompts_sha256,
        "round data": {rid: sha256_file_cached(path) for rid, path in pool},
        "round prompts": {r["id"]: r["batch_sha256"] for r in prompt_source(cfg).records() if r["id"] in dict(pool)},
    }
    promotion = Promotion(
        drafter,
        "refresh",
        gate.current,
        gate.reason,
        utc_now(),
        run_relative(cfg.run_dir, export_dir),
        gate.table(),
        digests,
    )
    card = export_dir / CARD_FILE
    line.promote(export_dir, promotion, card.read_text() if card.is_file() else "")


def close_round(
    cfg: RunConfig, line: Line, decisions: Journal, outcome: RefreshOutcome, answered: Path | None
) -> RefreshOutcome:
    """report.md, then the decision record that closes the round."""
    from eagle3.run.layout import run_relative

    assert outcome.round_id is not None
    outcome.current = line.current_id()
    report = round_dir(cfg, outcome.round_id) / REPORT_FILE
    outcome.report = str(report)
    atomic_write_text(report, refresh_markdown(outcome))
    with decisions.appender() as append:
        append(
            {
                "id": outcome.round_id,
                "status": outcome.status,
                "reason": outcome.reason,
                "current": outcome.current,
                "at": utc_now(),
                "answered": run_relative(cfg.run_dir, answered) if answered is not None else None,
            }
        )
    return outcome


def earlier_answers(cfg: RunConfig, decisions: Journal) -> list[tuple[str, Path]]:
    """(round id, answered Parquet file) of every decided round that had usable conversations, oldest first."""
    from eagle3.run.layout import resolve_in_run

    return [
        (d["id"], resolve_in_run(cfg.run_dir, d["answered"]))
        for d in sorted(decisions.load().values(), key=lambda d: d["id"])
        if d.get("answered")
    ]


def ingest_summary(cfg: RunConfig, where: Path) -> dict[str, Any]:
    """Counts of the round's merge (and regeneration) for the report."""
    from eagle3.refresh.candidate import INGEST
    from eagle3.run.stage import read_manifest

    data = where / INGEST / "data"
    merge = ((read_manifest(data / "merge.manifest.json") or {}).get("stats") or {}).get("total") or {}
    regen = (read_manifest(data / "regenerate.manifest.json") or {}).get("stats") or {}
    summary = {"records read": merge.get("read"), "kept": merge.get("kept"), "rejected": merge.get("rejected")}
    if regen:
        summary["answered by the target"] = regen.get("success")
        summary["answer errors"] = regen.get("error")
    return {k: v for k, v in summary.items() if v is not None}


def train_summary(cand: RunConfig) -> dict[str, Any]:
    """Where the candidate started and how far it trained, for the report."""
    from eagle3.run.stage import read_manifest
    from eagle3.train import STAGE as TRAIN

    stats = (read_manifest(TRAIN.manifest(cand.run_dir)) or {}).get("stats") or {}
    return {
        "warm start": cand.refresh.init_from,
        "optimizer steps": stats.get("step"),
        "budget (refresh.max_steps)": cand.train.max_steps,
        "run directory": str(cand.run_dir),
    }
