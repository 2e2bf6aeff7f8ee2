"""Markdown of a refresh: the round's report (report.md and the flow's artifact), a promoted drafter's promotion
section, and the line's card (promoted/README.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagle3.refresh.records import Promotion, RefreshOutcome


def table_lines(table: list[dict[str, Any]]) -> list[str]:
    """Gate rows as a markdown table (acceptance length = tokens per target verify forward, bonus included)."""
    if not table:
        return ["Not measured by a gate."]
    lines = ["| prompts | n | promoted before | candidate | change |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['group']} | {r['num_prompts']} | {r['current']:.3f} | {r['candidate']:.3f} | "
        f"{r['candidate'] - r['current']:+.3f} |"
        for r in table
    ]
    return lines


def digest_lines(digests: dict[str, Any]) -> list[str]:
    """The sha256 of each input, one bullet each (nested dicts flattened as a/b)."""
    flat: list[tuple[str, Any]] = []
    for key, value in digests.items():
        items = value.items() if isinstance(value, dict) else [("", value)]
        flat += [(f"{key}/{sub}" if sub else key, v) for sub, v in items]
    return [f"- {name}: `{value}`" for name, value in flat] or ["- none recorded"]


def promotion_lines(p: Promotion) -> list[str]:
    """One promotion: what, when, why, the measured table and the data digests."""
    return [
        f"## Promotion `{p.id}` ({p.kind}, {p.at})",
        "",
        f"Replaces `{p.replaces}`. {p.reason}" if p.replaces else f"First promoted drafter. {p.reason}",
        "",
        f"Exported from `{p.source}`.",
        "",
        "Acceptance length on the gate prompts:",
        "",
        *table_lines(p.table),
        "",
        "Data and prompt digests (sha256):",
        "",
        *digest_lines(p.digests),
    ]


def refresh_markdown(o: RefreshOutcome) -> str:
    """The round's report: the decision first, then what was read, trained and measured."""
    lines = [
        f"# Refresh of `{o.run_name}`" + (f", round {o.round_id}" if o.round_id else ""),
        "",
        f"**{o.status}**: {o.reason}",
        "",
        f"Current drafter: `{o.current}`.",
        "",
    ]
    if o.new_lines is not None:
        lines += ["## New prompts", "", f"{o.new_lines} line(s) taken from `{o.source}`:", ""]
        lines += [f"- `{s['file']}` bytes {s['start']}..{s['end']} ({s['num_lines']} lines)" for s in o.spans]
        lines.append("")
    if o.ingest:
        lines += ["## Their conversations", "", *(f"- {k}: {v}" for k, v in o.ingest.items()), ""]
    if o.train:
        lines += ["## Candidate", "", *(f"- {k}: {v}" for k, v in o.train.items()), ""]
    if o.gate is not None:
        lines += [
            "## Gate",
            "",
            f"Method `{o.gate['method']}` on `{o.gate_prompts}` (sha256 "
            f"`{o.gate['prompts_sha256']}`); acceptance length = tokens per target verify forward.",
            "",
            *table_lines(o.gate_table),
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"
