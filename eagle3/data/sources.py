"""Readers for chat datasets: ShareGPT (JSON array or JSONL), OpenAI 'messages' JSONL, Parquet.

A reader yields, in file order, one item per record: a ``Conversation`` when the record is usable
and a ``Reject`` (with a reason from ``REJECT_REASONS`` and the whole raw record) otherwise, so the
merge can count every record and drop nothing silently. A whole source that cannot be read at
all (missing, empty, a directory, unknown format) raises ``SourceError`` before anything is yielded.

Normalized conversations are plain ``{"role", "content"}`` dicts with roles system/user/assistant.
Contents are kept verbatim (the chat template decides about whitespace); only hashing strips them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.config import CharsOf, SourceConfig
from eagle3.data.containers import TextEncoding, detect_encoding, first_content_char, iter_array, iter_lines
from eagle3.data.containers import record_format as _record_format
from eagle3.data.rejects import REJECT_REASONS, Reject, SourceError
from eagle3.run.paths import resolve_path

__all__ = [
    "REJECT_REASONS",
    "Conversation",
    "Reject",
    "SourceError",
    "SourceStream",
    "content_hash",
    "make_row_id",
    "normalize_records",
    "read_source",
    "source_path",
]

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}
# 'developer' is OpenAI's newer name for the system prompt; tool/function turns have no place in a
# drafter's plain chat data, so they are rejected as unknown roles rather than guessed at.
OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

SOURCE_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
ID_UNSAFE_RE = re.compile(r"[^A-Za-z0-9._:-]")
MAX_ID_CHARS = 120
SNIFF_RECORDS = 1000
JSON_EXTENSIONS = (".json", ".jsonl", ".ndjson")


@dataclass
class Conversation:
    """A validated, normalized conversation: the future row of merged.parquet (split not yet known)."""

    id: str
    source: str
    location: str
    messages: list[dict[str, str]]
    num_dropped_turns: int = 0
    """Leading non-user turns removed from a ShareGPT record (counted in the stats, not silent)."""

    @property
    def num_chars(self) -> int:
        """Characters of content over all turns."""
        return sum(len(m["content"]) for m in self.messages)


class SourceStream:
    """The iterator ``read_source`` returns; also says which format it picked."""

    def __init__(
        self, fmt: str, path: Path, items: Generator[Conversation | Reject, None, None], raw: Generator[Any, None, None]
    ):
        self.format, self.path, self._items, self._raw = fmt, path, items, raw

    def __iter__(self) -> SourceStream:
        return self

    def __next__(self) -> Conversation | Reject:
        return next(self._items)

    def close(self) -> None:
        """Stop early and release the file (the merge stops at a source's cap)."""
        self._items.close()
        self._raw.close()  # an unstarted _items never runs its finally, but the sniffing may have opened the file


class _BadRecord(Exception):
    """Raised inside record parsing; turned into a Reject by the caller."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


# ---------------------------------------------------------------- hashing and ids


def normalized_pairs(messages: list[dict[str, str]]) -> list[list[str]]:
    """[[role, stripped content], ...]: what two conversations must share to count as duplicates."""
    return [[m["role"], m["content"].strip()] for m in messages]


def content_hash(messages: list[dict[str, str]]) -> str:
    """Hex sha256 of a canonical JSON of the normalized messages (roles + whitespace-stripped contents)."""
    text = json.dumps(normalized_pairs(messages), ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def make_row_id(source: str, id_in_source: str) -> str:
    """'<source>:<id>' with unsafe characters replaced by '_' and long ids cut (plus a hash of the original)."""
    full = f"{source}:{id_in_source}"
    safe = ID_UNSAFE_RE.sub("_", full)
    if len(safe) > MAX_ID_CHARS:
        # The hash of the uncut id keeps two long ids with a shared prefix apart.
        safe = (
            f"{safe[: MAX_ID_CHARS - 11]}-{hashlib.sha256(full.encode('utf-8', 'backslashreplace')).hexdigest()[:10]}"
        )
    return safe


def _explicit_id(record: dict[str, Any]) -> str | None:
    raw = record.get("id")
    if raw is None or raw == "":
        return None
    if isinstance(raw, bool) or not isinstance(raw, (str, int)):
        raise _BadRecord("unparsable", f"'id' must be a string or an integer, got {type(raw).__name__}")
    return str(raw)


# ---------------------------------------------------------------- opening a source


def source_path(src: SourceConfig) -> Path:
    """The source's file, or SourceError naming the source, the path and what is wrong with it."""
    if not SOURCE_NAME_RE.fullmatch(src.name):
        raise SourceError(f"source name {src.name!r} (path {src.path}): use only letters, digits, '-', '_' and '.'")
    assert src.path is not None, "SourceConfig requires a path unless the format is synthetic"
    try:
        path = resolve_path(src.path)
    except FileNotFoundError as exc:
        raise SourceError(f"source {src.name!r}: cannot resolve {src.path}: {exc}") from None
    if not path.exists():
        raise SourceError(f"source {src.name!r}: file {path} does not exist")
    if path.is_dir():
        raise SourceError(f"source {src.name!r}: {path} is a directory, expected a file")
    return path


def _pick_reader(src: SourceConfig, path: Path) -> tuple[str, TextEncoding | None]:
    """('parquet' | 'array' (one JSON array) | 'lines' (JSONL), text encoding) from config, extension, content."""
    is_parquet = src.format == "parquet" or (src.format == "auto" and path.suffix == ".parquet")
    if src.format == "auto" and not is_parquet and path.suffix not in JSON_EXTENSIONS:
        raise SourceError(
            f"source {src.name!r}: unknown format for {path} (extension {path.suffix!r}); "
            "set format to sharegpt, openai or parquet"
        )
    if path.stat().st_size == 0:
        raise SourceError(f"source {src.name!r}: file {path} is empty (0 bytes)")
    if is_parquet:
        return "parquet", None
    enc = detect_encoding(path)
    first = first_content_char(path, enc)  # a BOM-only file is as empty as a blank one
    if first is None:
        raise SourceError(f"source {src.name!r}: file {path} ({enc.name}) holds only whitespace")
    # A JSONL line may itself be an array, so only a .json file is read as one array when it starts with '['.
    return ("array" if first == "[" and path.suffix not in (".jsonl", ".ndjson") else "lines"), enc


def read_source(src: SourceConfig, max_chars: int, chars_of: CharsOf = "all") -> SourceStream:
    """Every record of one source, in file order, as Conversation or Reject (SourceError up front).

    Lazy: records are parsed only as the caller asks for them, so stopping after N rows costs N rows.
    """
    path = source_path(src)
    reader, enc = _pick_reader(src, path)
    if enc is None:
        fmt, raw = _open_parquet(src, path)
    else:
        raw = (iter_array if reader == "array" else iter_lines)(src.name, path, enc)
        fmt, raw = _choose_format(src, path, enc, raw)
    return SourceStream(fmt, path, normalize_records(src.name, fmt, raw, max_chars, chars_of), raw)


def _choose_format(
    src: SourceConfig, path: Path, enc: TextEncoding, raw: Generator[Any, None, None]
) -> tuple[str, Generator[Any, None, None]]:
    """The configured format, or (auto) the first record's: 'messages' -> openai, 'conversations' -> sharegpt."""
    if src.format in ("sharegpt", "openai"):
        return src.format, raw
    # Look ahead over a few records so one broken first line does not decide the whole file.
    peeked, fmt = [], None
    for item in raw:
        peeked.append(item)
        fmt = _record_format(item[1]) if isinstance(item, tuple) else None
        if fmt or len(peeked) >= SNIFF_RECORDS:
            break
    if not fmt:
        raw.close()
        what = f"none of the first {len(peeked)} records has" if peeked else "it holds no record with"
        raise SourceError(
            f"source {src.name!r}: cannot tell the format of {path} (read as {enc.name}): {what} "
            "a 'messages' or 'conversations' list; set format to sharegpt or openai"
        )
    return fmt, _prepend(peeked, raw)


def _prepend(peeked: list, raw: Generator[Any, None, None]) -> Generator[Any, None, None]:
    """The looked-ahead items, then the rest; closing it closes the file."""
    try:
        yield from peeked
        yield from raw
    finally:
        raw.close()


# ---------------------------------------------------------------- raw records per container


def _open_parquet(src: SourceConfig, path: Path) -> tuple[str, Generator[tuple[str, Any] | Reject, None, None]]:
    """Format from the columns ('messages' or 'conversations', optional 'id') and a lazy row iterator."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pfile = pq.ParquetFile(path)
        names = set(pfile.schema_arrow.names)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:  # a damaged footer may hold non-UTF-8 names
        raise SourceError(f"source {src.name!r}: cannot read {path} as Parquet: {exc}") from None
    fmt = "openai" if "messages" in names else "sharegpt" if "conversations" in names else None
    if fmt is None:
        raise SourceError(
            f"source {src.name!r}: {path} has no 'messages' or 'conversations' column (columns: {sorted(names)})"
        )
    columns = [c for c in ("id", "messages" if fmt == "openai" else "conversations") if c in names]
    return fmt, _iter_parquet_rows(src.name, pfile, columns, path)


def _iter_parquet_rows(
    source: str, pfile: Any, columns: list[str], path: Path
) -> Generator[tuple[str, Any] | Reject, None, None]:
    """(location, row dict) per row; a row group that cannot be decoded stops the source with its row number."""
    import pyarrow as pa

    num = 0
    batches = pfile.iter_batches(batch_size=1024, columns=columns)
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as exc:
            # The rows after a corrupt page cannot be located, so the rest of the file is not guessed at.
            raise SourceError(
                f"source {source!r}: {path} is corrupt from row {num} on ({exc}); {num} rows were read before it"
            ) from None
        if batch is None:
            return
        for row in _batch_rows(source, batch, path.name, num):
            yield row
            num += 1


def _batch_rows(source: str, batch: Any, file_name: str, first: int) -> list[tuple[str, Any] | Reject]:
    """The batch's rows; if a string in it is not UTF-8 (Parquet does not check), row by row, rejecting those."""
    try:
        return [(f"{file_name}#row {first + i}", row) for i, row in enumerate(batch.to_pylist())]
    except UnicodeDecodeError:
        pass
    rows: list[tuple[str, Any] | Reject] = []
    for i in range(batch.num_rows):
        loc = f"{file_name}#row {first + i}"
        try:
            rows.append((loc, batch.slice(i, 1).to_pylist()[0]))
        except UnicodeDecodeError as exc:
            rows.append(
                Reject(
                    source,
                    loc,
                    "invalid_utf8",
                    f"a string in the row is not UTF-8 ({exc.reason} at byte {exc.start})",
                    {"raw": repr(exc.object[:200])},
                )
            )
    return rows


# ---------------------------------------------------------------- one record -> Conversation | Reject


def _turn_pairs(record: Any, fmt: str) -> list[tuple[Any, Any]]:
    """(role, content) per turn, before any checks on their values."""
    sharegpt = fmt == "sharegpt"
    key, role_key, content_key = ("conversations", "from", "value") if sharegpt else ("messages", "role", "content")
    if not isinstance(record, dict):
        raise _BadRecord("unparsable", f"record is a JSON {type(record).__name__}, not an object")
    turns = record.get(key)
    if not isinstance(turns, list):
        raise _BadRecord("unparsable", f"record has no '{key}' list")
    pairs = []
    for num, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _BadRecord("unparsable", f"turn {num} is a JSON {type(turn).__name__}, not an object")
        pairs.append((turn.get(role_key), turn.get(content_key)))
    return pairs


def _is_utf8_text(text: str) -> bool:
    # Lone surrogates come from non-UTF-8 bytes (surrogateescape) or from '\udXXX' JSON escapes;
    # either way they cannot be written to Parquet or tokenized.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _normalize_turns(pairs: list[tuple[Any, Any]], fmt: str) -> list[dict[str, str]]:
    """Map roles and check each turn's content; the first bad turn decides the reason."""
    role_map = SHAREGPT_ROLES if fmt == "sharegpt" else OPENAI_ROLES
    messages = []
    for num, (raw_role, content) in enumerate(pairs):
        # Roles are matched case-insensitively: 'Human' and 'GPT' occur in ShareGPT dumps.
        role = role_map.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise _BadRecord("unknown_role", f"turn {num} has role {raw_role!r}; known: {sorted(role_map)}")
        if not isinstance(content, str):
            raise _BadRecord("non_string_content", f"turn {num} ({raw_role}) content is {type(content).__name__}")
        if not _is_utf8_text(content):
            raise _BadRecord("invalid_utf8", f"turn {num} ({raw_role}) content holds bytes that are not UTF-8")
        messages.append({"role": role, "content": content})
    return messages


def _drop_leading_non_user(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """ShareGPT dumps were split into chunks, so many start mid-dialogue with a bot turn: drop turns
    before the first user turn, except a system prompt in first place (it still applies)."""
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    keep_system = messages[:1] if messages[0]["role"] == "system" else []
    return keep_system + messages[first_user:] if first_user else messages


def _check_conversation(messages: list[dict[str, str]], max_chars: int, chars_of: CharsOf = "all") -> None:
    if not messages or all(not m["content"].strip() for m in messages):
        raise _BadRecord("empty_conversation", f"{len(messages)} turns, all empty")
    roles = {m["role"] for m in messages}
    if "user" not in roles:
        raise _BadRecord("no_user_turn", "no user turn")
    if "assistant" not in roles:
        raise _BadRecord("no_assistant_turn", "no assistant turn (after the first user turn)")
    num_chars = sum(len(m["content"]) for m in messages if chars_of == "all" or m["role"] != "assistant")
    if num_chars > max_chars:
        counted = "" if chars_of == "all" else " in system and user turns"
        raise _BadRecord("too_long", f"{num_chars:,} characters{counted} > max_chars {max_chars:,}")


def _to_messages(record: Any, fmt: str, max_chars: int, chars_of: CharsOf = "all") -> tuple[list[dict[str, str]], int]:
    """Validated messages and the number of leading turns dropped (ShareGPT only)."""
    messages = _normalize_turns(_turn_pairs(record, fmt), fmt)
    if fmt == "sharegpt" and any(m["role"] == "user" for m in messages):
        num_before = len(messages)
        messages = _drop_leading_non_user(messages)
        dropped = num_before - len(messages)
    else:
        dropped = 0
    _check_conversation(messages, max_chars, chars_of)
    return messages, dropped


def normalize_records(
    source: str, fmt: str, raw: Generator[Any, None, None], max_chars: int, chars_of: CharsOf = "all"
) -> Generator[Conversation | Reject, None, None]:
    """Raw (location, record) items -> Conversation | Reject, with ids unique within the source."""
    first_seen: dict[str, str] = {}  # row id -> location that took it
    try:
        for item in raw:
            if isinstance(item, Reject):
                yield item
                continue
            yield _one_record(source, fmt, item[0], item[1], max_chars, first_seen, chars_of)
    finally:
        raw.close()  # the merge may stop early: close the file now, not at garbage collection


def _one_record(
    source: str, fmt: str, loc: str, record: Any, max_chars: int, first_seen: dict[str, str], chars_of: CharsOf = "all"
) -> Conversation | Reject:
    row_id = None
    try:
        explicit = _explicit_id(record) if isinstance(record, dict) else None
        row_id = make_row_id(source, explicit) if explicit is not None else None
        messages, dropped = _to_messages(record, fmt, max_chars, chars_of)
    except _BadRecord as bad:
        return Reject(source, loc, bad.reason, bad.detail, record, row_id)
    if row_id is None:
        row_id = _unused_hash_id(source, messages, first_seen)
    elif row_id in first_seen:
        # Never overwrite: two records whose ids are equal (or become equal once sanitized) cannot both be rows.
        detail = f"id {explicit!r} -> {row_id!r} already taken by {first_seen[row_id]}"
        return Reject(source, loc, "duplicate_id", detail, record, row_id)
    first_seen[row_id] = loc
    return Conversation(row_id, source, loc, messages, dropped)


def _unused_hash_id(source: str, messages: list[dict[str, str]], first_seen: dict[str, str]) -> str:
    """'h' + 16 hex of the content hash; repeats of identical id-less records get '.2', '.3', ...

    Repeats are numbered rather than rejected: they are duplicates of content (the merge's dedupe
    decides), not of ids, and with dedupe off the user asked to keep them.
    """
    base = make_row_id(source, "h" + content_hash(messages)[:16])
    row_id, num = base, 1
    while row_id in first_seen:
        num += 1
        row_id = f"{base}.{num}"
    return row_id
