"""What a chat-source reader yields for a record that cannot become a row, and how it is written.

Kept apart from the readers so the container readers (eagle3.data.containers) and the record
normalizer (eagle3.data.sources) share one Reject type without importing each other.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

FILTER_REASONS = ("empty_turn", "truncated", "duplicate_prompt", "near_duplicate", "degenerate", "eval_overlap")
"""Reasons of the checks on readable records: generated ones (eagle3.data.synthetic), eval_overlap on every source."""
REJECT_REASONS = (
    "unparsable", "invalid_utf8", "empty_conversation", "no_user_turn", "no_assistant_turn", "unknown_role",
    "non_string_content", "duplicate_id", "duplicate_content", "too_long", *FILTER_REASONS,
)
"""Why a record was rejected (one of these is in every line of rejects.jsonl)."""


class SourceError(ValueError):
    """A whole source cannot be read (missing, empty, a directory, unknown format or encoding)."""


@dataclass
class Reject:
    """One record that did not become a row, with everything needed to find and fix it."""

    source: str
    location: str
    """'file.jsonl:17' (line), 'file.json#[123]' (array index), 'file.parquet#row 5', 'file.json@byte N'."""
    reason: str
    detail: str
    record: Any
    """The raw record as parsed JSON, or the raw text when it did not parse."""
    id: str | None = None

    def __post_init__(self) -> None:
        assert self.reason in REJECT_REASONS, self.reason

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (one line of rejects.jsonl); shallow, so a deeply nested record is not walked here."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _finite(value: Any) -> Any:
    """The value with NaN/Infinity floats (not JSON) replaced by their names as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # 'nan', 'inf', '-inf'
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def reject_line(reject: Reject) -> bytes:
    """One line of rejects.jsonl: always valid JSON (no NaN), UTF-8 (bad text kept as \\udcXX escapes)."""
    doc = reject.to_json()
    try:
        line = json.dumps(doc, ensure_ascii=False, allow_nan=False, default=repr)
    except ValueError:  # a NaN or Infinity float, e.g. a float 'id' column of a Parquet source
        try:
            line = json.dumps({**doc, "record": _finite(doc["record"])}, ensure_ascii=False, default=repr)
        except RecursionError:
            line = _unwritable(doc)
    except RecursionError:
        line = _unwritable(doc)
    return line.encode("utf-8", "backslashreplace") + b"\n"


def _unwritable(doc: dict[str, Any]) -> str:
    """The reject without its record, which nests too deeply to serialize (its location still finds it)."""
    note = "record nested too deeply to write here; read it at the location"
    return json.dumps({**doc, "record": None, "detail": f"{doc['detail']} ({note})"}, ensure_ascii=False,
                      allow_nan=False, default=repr)
