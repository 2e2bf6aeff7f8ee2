"""The refresh's records: a drafter's promotion (promotion.json) and what one refresh did (its report and the
flow's artifact are rendered from it by eagle3.refresh.report)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Promotion:
    """promotion.json: one drafter's promotion."""

    id: str
    kind: str  # refresh (passed the gate) | manual (eagle3 promote) | initial (the run's export, first refresh)
    replaces: str | None  # the drafter that was current before (rollback returns to it)
    reason: str
    at: str  # UTC time
    source: str  # the export folder copied
    table: list[dict[str, Any]] = field(default_factory=list)  # gate rows (group, prompts, current, candidate)
    digests: dict[str, Any] = field(default_factory=dict)  # sha256 of the data and prompts it was judged on

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Promotion:
        """The record ``to_json`` wrote."""
        return cls(**{k: doc[k] for k in cls.__dataclass_fields__ if k in doc})


@dataclass
class RefreshOutcome:
    """What one refresh did: the flow's artifact and the command's output are rendered from it."""

    run_name: str
    status: str  # promoted | kept | no new prompts
    reason: str
    current: str | None  # the current drafter afterwards
    source: str
    round_id: str | None = None
    new_lines: int | None = None
    spans: list[dict[str, Any]] = field(default_factory=list)
    ingest: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    gate: dict[str, Any] | None = None
    gate_table: list[dict[str, Any]] = field(default_factory=list)
    gate_prompts: str | None = None
    report: str | None = None  # report.md of the round

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict."""
        return asdict(self)
