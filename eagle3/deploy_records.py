"""The deploy stage's typed records: one server's benchmark (ServerRun, what results.json keeps per server) and the
written comparison (DeployReport). The stage (eagle3.deploy) makes them, the report (eagle3.deploy_report) reads
them, and the Prefect tasks pass them between each other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from eagle3.deploy_checks import AcceptCheck, SameTextCheck

if TYPE_CHECKING:
    from infra.sglang_bench import BenchResult

Role = Literal["baseline", "speculative"]


@dataclass(frozen=True)
class ServerRun:
    """One server's benchmark: how it was launched, what its readiness probe saw, and the measured levels."""

    role: Role
    argv: str  # printable command line (the API key is in a file, never on it)
    log: str
    pid: int | None
    ready: dict[str, Any]  # {smoke, elapsed_s, version} of infra.sglang.ReadyReport
    result: BenchResult
    trio: str | None = None  # 'steps-topk-draft_tokens' of a speculative server; 'ngram': SGLang's n-gram server
    groups: tuple[str, ...] = ()  # each prompt's dataset, in prompt order

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (round-trips through ``from_json``; results.json holds it per role)."""
        return {
            "role": self.role,
            "argv": self.argv,
            "log": self.log,
            "pid": self.pid,
            "ready": dict(self.ready),
            "result": self.result.to_json(),
            "trio": self.trio,
            "groups": list(self.groups),
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ServerRun:
        from infra.sglang_bench import BenchResult

        return cls(
            doc["role"],
            doc["argv"],
            doc["log"],
            doc["pid"],
            dict(doc["ready"]),
            BenchResult.from_json(doc["result"]),
            doc.get("trio"),
            tuple(doc.get("groups") or ()),
        )


@dataclass(frozen=True)
class DeployReport:
    """The written comparison: results.json, report.md, one row per EAGLE-3 setting and level, the report's text."""

    results: Path
    report: Path
    comparison: list[dict[str, Any]]
    markdown: str
    accept_checks: list[AcceptCheck | SameTextCheck] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (what the Prefect task and the CLI return)."""
        return {
            "results": str(self.results),
            "report": str(self.report),
            "comparison": self.comparison,
            "accept_checks": [asdict(c) for c in self.accept_checks],
        }
