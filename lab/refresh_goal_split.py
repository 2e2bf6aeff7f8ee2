"""A finished run's training conversations in two halves, by a hash of the conversation id (lab/refresh_goal.py split).

Input: the conversations the run's tokenize stage read (its regenerated.parquet, or merged.parquet without
regeneration: eagle3.refresh.candidate.answered_file), every answer already the target's or kept on purpose, and
its tokenized.parquet for the token counts. Only rows of the run's train split are taken: its validation rows
never trained the full-data drafter, so neither half holds them; the runs that merge a half draw their own
validation rows from it by data.val_fraction, and apply the evaluation-overlap check again, as every merge does.

Output, one JSON line a conversation in the input's order (OpenAI ``messages``, the run's row id as ``id``):
half A, a file source of the half-data run (format openai, keep_answers: its answers are trained on as written),
and half B, the refresh's prompt file (refresh.regenerate: false). The same input gives the same bytes, so a
rewritten half B passes the refresh source's check of the bytes under its watermark.

The one thing the halves lose: regenerated.parquet's ``truncated_turns`` (answers cut at the token cap or at a
loop, whose end-of-turn text tokenize leaves unsupervised). A merge reads messages only, so both halves' answers
count as finished there, as the refresh's own pool (a Parquet source) does with the run's conversations.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from infra.storage import atomic_open

SALT = "refresh-goal"
"""Seeds the hash that picks a conversation's half (changing it gives other halves)."""
HALVES = ("a", "b")


def half_of(row_id: str) -> str:
    """'a' or 'b': the low bit of the first byte of sha256(SALT, id); stable across runs, machines and row order."""
    return HALVES[hashlib.sha256(f"{SALT}\0{row_id}".encode()).digest()[0] & 1]


@dataclass
class HalfCount:
    """One half's conversations and the tokens the run's tokenize stage gave them."""

    rows: int = 0
    tokens: int = 0


@dataclass
class SplitSummary:
    """What split wrote (goal/split.json)."""

    source: str
    halves: dict[str, HalfCount] = field(default_factory=lambda: {h: HalfCount() for h in HALVES})
    val_rows_left_out: int = 0
    rows_not_tokenized: int = 0
    """Train rows tokenize dropped (too few supervised tokens): in a half, and dropped again by its run."""

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict."""
        return asdict(self)


def train_tokens(tokenized: Path) -> dict[str, int]:
    """Row id -> tokens, for the train split of a tokenized.parquet."""
    table = pq.read_table(tokenized, columns=["id", "split", "num_tokens"]).to_pydict()
    return {i: n for i, s, n in zip(table["id"], table["split"], table["num_tokens"]) if s == "train"}


def record(row: dict[str, Any]) -> bytes:
    """One JSON line: the row's id and its messages (role and content only)."""
    messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    return json.dumps({"id": row["id"], "messages": messages}, ensure_ascii=False).encode("utf-8") + b"\n"


def split_halves(answered: Path, tokenized: Path, out: dict[str, Path]) -> SplitSummary:
    """Write the train rows of ``answered`` to out["a"] and out["b"] by half_of(id); the counts."""
    tokens = train_tokens(tokenized)
    rows = pq.read_table(answered, columns=["id", "split", "messages"]).to_pylist()
    summary = SplitSummary(str(answered))
    with atomic_open(out["a"]) as fa, atomic_open(out["b"]) as fb:
        files = {"a": fa, "b": fb}
        for row in rows:
            if row["split"] != "train":
                summary.val_rows_left_out += 1
                continue
            half = half_of(row["id"])
            files[half].write(record(row))
            summary.halves[half].rows += 1
            summary.halves[half].tokens += tokens.get(row["id"], 0)
            summary.rows_not_tokenized += row["id"] not in tokens
    return summary
