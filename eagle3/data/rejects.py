"""What a chat-source reader yields for a record that cannot become a row, and how it is written.

Kept apart from the readers so the container readers (eagle3.data.containers) and the record
normalizer (eagle3.data.sources) share one Reject type without importing each other.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, fields
from typing import Any

FILTER_REASONS = ("empty_turn", "truncated", "duplicate_prompt", "near_duplicate", "degenerate", "eval_overlap")
"""Reasons of the checks on readable records: generated ones (eagle3.data.synthetic), eval_overlap on every source."""
REJECT_REASONS = (
    "unparsable",
    "invalid_utf8",
    "empty_conversation",
    "no_user_turn",
    "no_assistant_turn",
    "unknown_role",
    "non_string_content",
    "duplicate_id",
    "duplicate_content",
    "too_long",
    *FILTER_REASONS,
)
"""Why a record was rejected (one of these is in every line of rejects.jsonl)."""
RECORD_CAP_CHARS = 16_384
"""A reject's record longer than this (as JSON) is written as an excerpt of this many characters plus the sha256
and size of the whole record, so one huge record never makes rejects.jsonl (or the memory writing it) huge."""


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
    offset: int | None = None
    """Byte offset of the record in its file, where the reader knows it (JSON Lines in UTF-8)."""
    sha256: str | None = None
    """sha256 of the record's bytes in the file, set by a reader that wrote only an excerpt as ``record``."""
    size: int | None = None
    """The record's size in bytes in the file, set with ``sha256``."""

    def __post_init__(self) -> None:
        assert self.reason in REJECT_REASONS, self.reason

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (one line of rejects.jsonl); shallow, so a deeply nested record is not walked here.
        The optional fields (offset, sha256, size) appear only when set."""
        optional = ("offset", "sha256", "size")
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in optional or getattr(self, f.name) is not None
        }


def excerpt_of(text: str, size: int, unit: str = "bytes") -> str:
    """The first RECORD_CAP_CHARS characters of ``text`` (the head of a record of ``size`` ``unit``), marked."""
    return f"{text[:RECORD_CAP_CHARS]} [... excerpt: the record is {size} {unit}]"


def _bounded(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` whose record, when its JSON is longer than RECORD_CAP_CHARS, is an excerpt of that JSON with
    record_truncated, record_chars and (unless the reader set it from the bytes) the sha256 of the JSON's UTF-8.

    The JSON is produced piece by piece (only the first RECORD_CAP_CHARS are kept), so a record costs about its
    own size once more, never a whole escaped copy; NaN raises ValueError as json.dumps would."""
    if doc.get("sha256") is not None:
        return {**doc, "record_truncated": True}  # the reader kept only an excerpt (and hashed the bytes)
    encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False, default=repr)
    digest, head, length = hashlib.sha256(), [], 0
    for piece in encoder.iterencode(doc["record"]):
        if length < RECORD_CAP_CHARS:
            head.append(piece[:RECORD_CAP_CHARS])
        length += len(piece)
        for at in range(0, len(piece), 1 << 20):  # a huge string is one piece: encode it a slice at a time
            digest.update(piece[at : at + (1 << 20)].encode("utf-8", "surrogatepass"))
    if length <= RECORD_CAP_CHARS:
        return doc
    extra: dict[str, Any] = {"record_truncated": True, "record_chars": length}
    if doc.get("sha256") is None:
        extra["sha256"] = digest.hexdigest()
    return {**doc, "record": excerpt_of("".join(head), length, "characters of JSON"), **extra}


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
    """One line of rejects.jsonl: always valid JSON (no NaN), UTF-8 (bad text kept as \\udcXX escapes), bounded
    (a record longer than RECORD_CAP_CHARS as JSON is written as an excerpt with its sha256 and size)."""
    doc = reject.to_json()
    try:
        line = json.dumps(_bounded(doc), ensure_ascii=False, allow_nan=False, default=repr)
    except ValueError:  # a NaN or Infinity float, e.g. a float 'id' column of a Parquet source
        try:
            line = json.dumps(_bounded({**doc, "record": _finite(doc["record"])}), ensure_ascii=False, default=repr)
        except RecursionError:
            line = _unwritable(doc)
    except RecursionError:
        line = _unwritable(doc)
    return line.encode("utf-8", "backslashreplace") + b"\n"


def _unwritable(doc: dict[str, Any]) -> str:
    """The reject without its record, which nests too deeply to serialize (its location still finds it)."""
    note = "record nested too deeply to write here; read it at the location"
    return json.dumps(
        {**doc, "record": None, "detail": f"{doc['detail']} ({note})"},
        ensure_ascii=False,
        allow_nan=False,
        default=repr,
    )
