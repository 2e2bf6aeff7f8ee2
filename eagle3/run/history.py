"""The acceptance history of a run name: one record per pipeline run that evaluated, for a trend across runs.

Each run directory is one run name, re-run many times (schedules, changed overrides, retries). Its evaluation
overwrites eval/results.json, so the figures of earlier runs would be lost; the pipeline appends what each run
measured to ``<run>/history/acceptance.jsonl`` (RunLayout.acceptance_history) when it finishes with the evaluate
stage, and the trend table is read back from that file. The file lives in the run directory, outside every
stage's folder (no stage removes it), and holds no absolute path, so it moves with the run. It is an
eagle3.run.journal: each record is one appended, fsynced line (a torn last line is ignored on reading), keyed by
the flow run's id, so a retried flow run rewrites its own record instead of adding a second.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from eagle3.run.journal import Journal

NGRAM = "ngram"
TREND_FIXED_COLUMNS = ("date", "flow run", "evaluation", "prompts")


@dataclass(frozen=True)
class AcceptanceRecord:
    """What one pipeline run measured: its flow run, when, and the acceptance length per method."""

    run_id: str
    """The flow run's id (the journal's key)."""
    date: str
    """When the run finished, ISO 8601 in UTC to the second."""
    flow_run: str
    """The flow run's name (what the UI lists)."""
    computed: bool
    """True: this run measured; False: the evaluation was up to date and its figures are an earlier run's."""
    dataset: str
    """The rows the figures are from: 'all' with several datasets, else the one dataset."""
    num_prompts: int
    accept_len: dict[str, float] = field(default_factory=dict)
    """{method: acceptance length} (chain-S-1-N, tree-S-K-N, ngram)."""

    def to_json(self) -> dict[str, Any]:
        """The journal line (``id`` is the journal's key)."""
        return {
            "id": self.run_id,
            "date": self.date,
            "flow_run": self.flow_run,
            "computed": self.computed,
            "dataset": self.dataset,
            "num_prompts": self.num_prompts,
            "accept_len": dict(self.accept_len),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> AcceptanceRecord:
        return cls(
            str(doc["id"]),
            str(doc["date"]),
            str(doc["flow_run"]),
            bool(doc["computed"]),
            str(doc["dataset"]),
            int(doc["num_prompts"]),
            {str(k): float(v) for k, v in dict(doc["accept_len"]).items()},
        )


def acceptance_record(
    results: Mapping[str, Any], run_id: str, flow_run: str, finished: datetime, computed: bool
) -> AcceptanceRecord | None:
    """The record of a run from its eval/results.json document; None when it holds no result row.

    With several datasets the evaluation adds an 'all' row per method, which is the one recorded; with one
    dataset, that dataset's rows."""
    rows = [r for r in results.get("results") or [] if isinstance(r, Mapping) and "accept_len" in r]
    if not rows:
        return None
    pooled = [r for r in rows if r.get("dataset") == "all"]
    rows = pooled or [r for r in rows if r.get("dataset") == rows[0].get("dataset")]
    utc = finished.astimezone(timezone.utc) if finished.tzinfo is not None else finished  # naive: taken as UTC
    return AcceptanceRecord(
        run_id=run_id,
        date=utc.strftime("%Y-%m-%dT%H:%M:%SZ"),
        flow_run=flow_run,
        computed=computed,
        dataset=str(rows[0].get("dataset")),
        num_prompts=max(int(r.get("num_prompts") or 0) for r in rows),
        accept_len={str(r["method"]): float(r["accept_len"]) for r in rows},
    )


def append_acceptance(path: Path, record: AcceptanceRecord) -> None:
    """Append ``record`` as one fsynced line (Journal.appender: a single write in append mode)."""
    with Journal(path).appender() as append:
        append(record.to_json())


def read_acceptance(path: Path) -> list[AcceptanceRecord]:
    """The records of ``path`` in the order their runs were first appended (one per flow run; none if absent).
    A line that is not a record (torn, or written by a newer version without a field) is left out."""
    records = []
    for doc in Journal(path).load().values():
        try:
            records.append(AcceptanceRecord.from_json(doc))
        except (KeyError, TypeError, ValueError):
            continue
    return records


def trend_methods(records: Sequence[AcceptanceRecord]) -> list[str]:
    """The methods measured by any of ``records``: the n-gram baseline first, then the others in first-seen order."""
    seen = list(dict.fromkeys(m for r in records for m in r.accept_len))
    return ([NGRAM] if NGRAM in seen else []) + [m for m in seen if m != NGRAM]


def trend_rows(records: Sequence[AcceptanceRecord], max_columns: int = 8) -> list[dict[str, Any]]:
    """The acceptance-trend table: one row per record, oldest first: TREND_FIXED_COLUMNS, then one column per method
    (trend_methods; "" where a run did not measure it). Methods beyond ``max_columns`` columns in all share a last
    'more methods' column ("name value; ..."), so the table is never cut off in the UI."""
    methods = trend_methods(records)
    room = max(1, max_columns - len(TREND_FIXED_COLUMNS))
    shown, rest = (methods, []) if len(methods) <= room else (methods[: room - 1], methods[room - 1 :])
    rows = []
    for r in records:
        row: dict[str, Any] = {
            "date": r.date.replace("T", " ").removesuffix("Z") + " UTC",
            "flow run": r.flow_run,
            "evaluation": "measured" if r.computed else "up to date (earlier figures)",
            "prompts": r.num_prompts,
        }
        row |= {m: _fmt(r.accept_len.get(m)) for m in shown}
        if rest:
            row["more methods"] = "; ".join(f"{m} {_fmt(r.accept_len[m])}" for m in rest if m in r.accept_len)
        rows.append(row)
    return rows


def _fmt(value: float | None) -> str:
    """An acceptance length to 3 decimals, "" when not measured."""
    return "" if value is None else f"{value:.3f}"
