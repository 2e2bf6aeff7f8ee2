"""The prompt source of a refresh and its watermark: every complete line exactly once, in order.

The source (``refresh.prompts``) is a folder of ``*.jsonl`` files (read in name order; names starting with '.' are
left alone) or one JSONL file that grows. Files are known by name, and a file is only ever appended to: the
watermark is, per file, the byte offset just past the last line already taken. A read takes the complete lines
(ending in a newline) past it; a line still being written waits for the next read.

Taking lines is one fsynced journal record per round (``refresh/watermark.jsonl``, eagle3.run.journal), written
after the round's batch file: a crash before the record re-reads the same lines into the same round, a crash after
it re-reads nothing (the round resumes from its batch file). The record also keeps the sha256 of the bytes just
before each new offset, and the next read checks it, so a file rewritten or truncated under the watermark is an
error naming the file instead of lines silently skipped or taken twice.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3.run.journal import Journal

TAIL_BYTES = 4096
"""Bytes before a watermark offset whose hash the next read checks (a whole-prefix hash would reread the file)."""


class SourceChangedError(ValueError):
    """A prompt file no longer holds, under its watermark, the bytes a refresh already took."""


@dataclass(frozen=True)
class Span:
    """The lines one round took from one file: bytes [start, end) and the hash of the bytes just before ``end``."""

    file: str  # name inside the folder, or the file's own name
    start: int
    end: int
    num_lines: int
    tail_sha256: str


@dataclass(frozen=True)
class NewLines:
    """What a read found past the watermark: the spans and their lines (newline stripped, blank lines left out)."""

    spans: list[Span]
    lines: list[bytes]


def source_files(source: Path) -> list[Path]:
    """The files of the source, in reading order."""
    if source.is_dir():
        return sorted(
            p for p in source.iterdir() if p.suffix == ".jsonl" and not p.name.startswith(".") and p.is_file()
        )
    if source.is_file():
        return [source]
    raise FileNotFoundError(f"refresh.prompts is {source}, which is neither a folder nor a file")


def _tail_hash(fh: Any, end: int) -> str:
    start = max(0, end - TAIL_BYTES)
    fh.seek(start)
    return hashlib.sha256(fh.read(end - start)).hexdigest()


class PromptSource:
    """``refresh.prompts`` read behind the watermark journal ``journal_path``."""

    def __init__(self, source: Path, journal_path: Path):
        self.source = Path(source)
        self.journal = Journal(journal_path)

    def records(self) -> list[dict[str, Any]]:
        """The watermark records, one per round, oldest first."""
        return sorted(self.journal.load().values(), key=lambda r: r["id"])

    def watermark(self) -> dict[str, Span]:
        """Per file, the span of the last round that took lines from it."""
        marks: dict[str, Span] = {}
        for record in self.records():
            for doc in record["spans"]:
                marks[doc["file"]] = Span(**doc)
        return marks

    def read_new(self, max_lines: int | None = None) -> NewLines:
        """Complete lines past the watermark, at most ``max_lines`` (blank ones skipped but taken)."""
        marks = self.watermark()
        spans: list[Span] = []
        lines: list[bytes] = []
        for path in source_files(self.source):
            budget = None if max_lines is None else max_lines - len(lines)
            if budget == 0:
                break
            span, taken = self._read_file(path, marks.get(path.name), budget)
            if span is not None:
                spans.append(span)
                lines += taken
        return NewLines(spans, lines)

    def _read_file(self, path: Path, mark: Span | None, budget: int | None) -> tuple[Span | None, list[bytes]]:
        start = mark.end if mark else 0
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if mark is not None:
                self._check_unchanged(path, fh, size, mark)
            fh.seek(start)
            end, num, taken = start, 0, []
            while budget is None or num < budget:
                line = fh.readline()
                if not line.endswith(b"\n"):
                    break  # end of file, or a line still being written
                end, num = end + len(line), num + 1
                if line.strip():
                    taken.append(line.rstrip(b"\r\n"))
            if num == 0:
                return None, []
            return Span(path.name, start, end, num, _tail_hash(fh, end)), taken

    @staticmethod
    def _check_unchanged(path: Path, fh: Any, size: int, mark: Span) -> None:
        if size < mark.end:
            raise SourceChangedError(
                f"{path} has {size} bytes, fewer than the {mark.end} a refresh already took: a "
                "prompt file may only grow (write new prompts to a new file instead)"
            )
        if _tail_hash(fh, mark.end) != mark.tail_sha256:
            raise SourceChangedError(
                f"{path} was rewritten: the bytes before offset {mark.end}, which a refresh "
                "already took, changed; a prompt file may only grow"
            )

    def commit(self, round_id: str, new: NewLines, batch_sha256: str) -> dict[str, Any]:
        """Record that round ``round_id`` took ``new`` (its batch file hashing to ``batch_sha256``); fsynced."""
        record = {
            "id": round_id,
            "spans": [asdict(s) for s in new.spans],
            "num_lines": len(new.lines),
            "batch_sha256": batch_sha256,
        }
        with self.journal.appender() as append:
            append(record)
        return record


def to_record(line: bytes, placeholder_answer: bool) -> bytes:
    """One source line as a line of the round's batch file (OpenAI ``messages`` JSONL, read by the merge).

    {"prompt": text} becomes one user turn; ShareGPT turns become messages. With ``placeholder_answer`` (the target
    answers them) a conversation ending in a user turn gets an empty assistant turn, which regeneration replaces
    (the merge keeps only conversations with an answer). Anything else is passed on as it is, so the merge rejects
    it with its reason in the round's rejects.jsonl: nothing is dropped silently.
    """
    try:
        record = json.loads(line)
    except ValueError:
        return line
    if not isinstance(record, dict):
        return line
    messages = _messages(record)
    if messages is None:
        return line
    if placeholder_answer and messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "user":
        messages = [*messages, {"role": "assistant", "content": ""}]
    out = {"messages": messages} | ({"id": record["id"]} if "id" in record else {})
    return json.dumps(out, ensure_ascii=False).encode("utf-8")


def _messages(record: dict[str, Any]) -> list[Any] | None:
    """The record's turns as OpenAI messages (None: a shape this module does not know; the merge judges it)."""
    if isinstance(record.get("prompt"), str) and "messages" not in record:
        return [{"role": "user", "content": record["prompt"]}]
    if isinstance(record.get("messages"), list):
        return list(record["messages"])
    from eagle3.data.sources import SHAREGPT_ROLES

    turns = record.get("conversations")
    if isinstance(turns, list) and all(isinstance(t, dict) for t in turns):
        return [
            {"role": SHAREGPT_ROLES.get(str(t.get("from")).strip().lower(), t.get("from")), "content": t.get("value")}
            for t in turns
        ]
    return None
