"""An append-only JSONL journal: what a long, resumable loop has finished, one fsynced line per item.

Regeneration journals every answered conversation and evaluation every measured prompt, so a run
killed at any point (a VM lost, a time limit) redoes only the items that had not finished.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO


class Journal:
    """Append-only JSONL of finished work items (one record per id), fsynced per record so a kill loses none."""

    def __init__(self, path: Path):
        self.path = path

    def load(self) -> dict[str, dict[str, Any]]:
        """Latest record per id; a torn last line (killed mid-write, at any byte) is ignored."""
        records: dict[str, dict[str, Any]] = {}
        if not self.path.exists():
            return records
        # Split the bytes on b"\n" only, then decode each line: a line torn inside a multi-byte character fails
        # to decode (a ValueError, skipped) instead of failing the whole file. b"\n" never occurs inside a UTF-8
        # character, and json.dumps(ensure_ascii=False) leaves U+2028, U+0085 and the like unescaped inside
        # strings, which str.splitlines() would cut in two.
        for line in self.path.read_bytes().split(b"\n"):
            with contextlib.suppress(ValueError):
                record = json.loads(line.decode("utf-8"))
                if isinstance(record, dict) and "id" in record:
                    records[record["id"]] = record
        return records

    @contextlib.contextmanager
    def _open(self) -> Iterator[BinaryIO]:
        """The file opened for appending, on a fresh line if the previous run died mid-line."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+b") as fh:
            if fh.tell() > 0:
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")
            yield fh

    @contextlib.contextmanager
    def appender(self) -> Iterator[Callable[[dict[str, Any]], None]]:
        """Yield append(record), which writes and fsyncs one record."""
        with self._open() as fh:

            def append(record: dict[str, Any]) -> None:
                fh.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
                fh.flush()
                os.fsync(fh.fileno())

            yield append

    def extend(self, records: Iterable[dict[str, Any]]) -> int:
        """Append many records with one fsync at the end (moving finished records, not live progress); how many."""
        num = 0
        with self._open() as fh:
            for record in records:
                fh.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
                num += 1
            fh.flush()
            os.fsync(fh.fileno())
        return num
