"""Raw records of a JSON source: one JSON array or JSON Lines, in UTF-8, UTF-16 or UTF-32.

A reader yields, in file order, ``(location, parsed value)`` per record or a ``Reject`` for a
record that cannot be parsed, so one bad record never costs another:

- JSON Lines: each line is parsed alone; a BOM may start any line (concatenated files carry one
  per part).
- One JSON array: records are decoded one by one from a sliding window, so a truncated file still
  yields every whole record. A record that does not decode is one reject at its index, and the
  reader re-synchronises at the next record: the first '{' after a ',' that decodes to an object
  shaped like a record (a 'messages' or 'conversations' list, or the keys of the previous record)
  and is followed by ',' or ']'. Text in which no further record can be found is one reject
  located by offset.

Parsing refuses what Python's json module accepts but JSON does not (NaN, Infinity), and its
failures on hostile input (nesting past the recursion limit, integers longer than Python converts)
become rejects of that one record.

Encodings: JSON text may be UTF-8, UTF-16 or UTF-32 (RFC 4627 section 3), with or without a BOM.
The encoding is told from the BOM or from where the first four bytes hold zeros, and decoded.
Bytes not valid in it become lone surrogates, which the record checks reject as invalid_utf8.
"""

from __future__ import annotations

import codecs
import hashlib
import io
import json
import re
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from eagle3.data.rejects import RECORD_CAP_CHARS, Reject, excerpt_of

READ_CHUNK_CHARS = 4 << 20
TAIL_HEAD_CHARS = 2000
LONE_SURROGATES = "eagle3.lone_surrogates"
SEPARATORS = " \t\r\n,\ufeff"
# UTF-32-LE's BOM starts with UTF-16-LE's, so it is tried first
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
_ZERO_PATTERNS: dict[tuple[bool, ...], str] = {  # which of the first 4 bytes are zero -> BOM-less encoding
    (True, True, True, False): "utf-32-be",
    (False, True, True, True): "utf-32-le",
    (True, False, True, False): "utf-16-be",
    (False, True, False, True): "utf-16-le",
}
_RECORD_START = re.compile(r",[\s\ufeff]*\{")
_LONE_SURROGATE = re.compile("[\udc00-\udcff]")
_NON_SPACE = re.compile(r"[^\s\ufeff]")


def _to_lone_surrogates(exc: UnicodeError) -> tuple[str, int]:
    """Each undecodable byte b -> U+DC00+b (for bytes >= 0x80 this is Python's surrogateescape)."""
    assert isinstance(exc, UnicodeDecodeError), "a decoding error handler"
    return "".join(chr(0xDC00 + b) for b in exc.object[exc.start : exc.end]), exc.end


codecs.register_error(LONE_SURROGATES, _to_lone_surrogates)


class Malformed(ValueError):
    """One record's text is not JSON (or is JSON Python cannot hold); the message says why."""


# ---------------------------------------------------------------- encodings


@dataclass(frozen=True)
class TextEncoding:
    """How a JSON source's bytes become text."""

    name: str
    """Python codec name: utf-8, utf-16-le, utf-16-be, utf-32-le or utf-32-be."""
    bom_bytes: int
    """Length of the BOM skipped at the start of the file (0 when there is none)."""


def detect_encoding(path: Path) -> TextEncoding:
    """The file's encoding, from its BOM or the zero bytes among its first four (UTF-8 otherwise)."""
    with open(path, "rb") as fh:
        head = fh.read(4)
    for bom, name in _BOMS:
        if head.startswith(bom):
            return TextEncoding(name, len(bom))
    name = _ZERO_PATTERNS.get(tuple(b == 0 for b in head), "utf-8") if len(head) == 4 else "utf-8"
    return TextEncoding(name, 0)


def open_text(path: Path, enc: TextEncoding) -> TextIO:
    """The file as text past its BOM; lines end at '\\n' only, as in the bytes."""
    fh = open(path, "rb")  # noqa: SIM115 (returned inside the wrapper: the caller closes it)
    fh.seek(enc.bom_bytes)
    return io.TextIOWrapper(fh, encoding=enc.name, errors=LONE_SURROGATES, newline="\n")


def first_content_char(path: Path, enc: TextEncoding) -> str | None:
    """First character that is not whitespace or a BOM, or None for a file with nothing in it."""
    with open_text(path, enc) as fh:
        while chunk := fh.read(1 << 16):
            stripped = chunk.lstrip(" \t\r\n\ufeff")
            if stripped:
                return stripped[0]
    return None


def show_text(text: str) -> str:
    """Text with the lone surrogates of undecodable bytes written as \\xNN (readable, valid UTF-8)."""
    return _LONE_SURROGATE.sub(lambda m: f"\\x{ord(m.group()) - 0xDC00:02x}", text)


# ---------------------------------------------------------------- parsing one record


def _refuse_constant(name: str) -> Any:
    raise Malformed(f"{name} is not valid JSON (numbers must be finite)")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def _decode(text: str, pos: int, whole: bool) -> tuple[Any, int]:
    """(value, end) of the JSON value at ``pos`` (``whole``: the text must hold nothing else); Malformed else."""
    try:
        if whole:
            return _DECODER.decode(text), len(text)
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError as exc:
        where = f"column {exc.colno}" if whole else f"character {exc.pos - pos} of the record"
        raise Malformed(f"invalid JSON: {exc.msg} ({where})") from None
    except RecursionError:
        raise Malformed("invalid JSON: nested deeper than the parser's recursion limit") from None
    except Malformed:
        raise
    except ValueError as exc:  # an integer longer than sys.get_int_max_str_digits()
        raise Malformed(f"invalid JSON: {str(exc).split(';')[0]}") from None


def record_format(value: Any) -> str | None:
    """'openai' for a 'messages' list, 'sharegpt' for a 'conversations' list, else None."""
    if isinstance(value, dict):
        if isinstance(value.get("messages"), list):
            return "openai"
        if isinstance(value.get("conversations"), list):
            return "sharegpt"
    return None


# ---------------------------------------------------------------- JSON Lines


def iter_lines(source: str, path: Path, enc: TextEncoding) -> Generator[tuple[str, Any] | Reject, None, None]:
    """JSONL: (location, parsed value) per non-blank line; bad text or bad JSON rejects only that line.

    UTF-8 (nearly every file) is read as bytes line by line: a line that is not UTF-8 is never decoded whole,
    and a reject of a line longer than RECORD_CAP_CHARS keeps an excerpt, the line's byte offset, size and
    sha256 (eagle3.data.rejects), so one huge line costs a small multiple of its size, not an escaped copy."""
    if enc.name != "utf-8":
        yield from _iter_text_lines(source, path, enc)
        return
    bom = codecs.BOM_UTF8
    with open(path, "rb") as fh:
        fh.seek(enc.bom_bytes)
        offset = enc.bom_bytes
        for num, raw in enumerate(fh, 1):
            start, offset = offset, offset + len(raw)
            skip = 0
            while raw.startswith(bom, skip):  # a BOM at the start of any part of a concatenated file
                skip += len(bom)
            loc = f"{path.name}:{num}"
            try:
                line = raw.decode("utf-8", "strict")[skip // len(bom) :]
            except UnicodeDecodeError as exc:
                yield _invalid_utf8_line(source, loc, raw, start, exc.start, skip)
                continue
            if not line.strip():
                continue  # a blank line is not a record
            try:
                value = _decode(line, 0, whole=True)[0]
            except Malformed as exc:
                yield _line_reject(
                    source, loc, "unparsable", str(exc), line.rstrip("\r\n"), _line_body(raw, skip), start
                )
                continue
            del raw, line  # hold only the parsed record while the caller has it (one huge line: ~1x less)
            yield loc, value


def _line_body(raw: bytes, skip: int) -> memoryview:
    """The line's bytes past ``skip`` BOM bytes and without its line end (no copy)."""
    end = len(raw)
    while end > skip and raw[end - 1] in b"\r\n":
        end -= 1
    return memoryview(raw)[skip:end]


def _line_reject(
    source: str, loc: str, reason: str, detail: str, shown: str, body: memoryview, start: int, whole: bool = True
) -> Reject:
    """A reject of one line: the whole line (``shown``, when ``whole``) if it is at most RECORD_CAP_CHARS long,
    else an excerpt and the sha256 and size of the line's bytes; the line's byte offset either way."""
    if whole and len(shown) <= RECORD_CAP_CHARS:
        return Reject(source, loc, reason, detail, shown, offset=start)
    return Reject(
        source,
        loc,
        reason,
        detail,
        excerpt_of(shown, len(body)),
        offset=start,
        sha256=hashlib.sha256(body).hexdigest(),
        size=len(body),
    )


def _invalid_utf8_line(source: str, loc: str, raw: bytes, start: int, bad: int, skip: int) -> Reject:
    """The invalid_utf8 reject of a UTF-8 line whose byte ``bad`` does not decode: only its head is decoded."""
    body = _line_body(raw, skip)
    detail = f"not valid utf-8 at character {len(raw[skip:bad].decode('utf-8'))} of the line"
    shown = show_text(bytes(body[:RECORD_CAP_CHARS]).decode("utf-8", LONE_SURROGATES))
    return _line_reject(source, loc, "invalid_utf8", detail, shown, body, start, len(body) <= RECORD_CAP_CHARS)


def _iter_text_lines(source: str, path: Path, enc: TextEncoding) -> Iterator[tuple[str, Any] | Reject]:
    """JSONL in UTF-16 or UTF-32: decoded by a text reader (a huge reject is bounded when written)."""
    with open_text(path, enc) as fh:
        for num, line in enumerate(fh, 1):
            line = line.lstrip("\ufeff")  # a BOM at the start of any part of a concatenated file
            if not line.strip():
                continue  # a blank line is not a record
            loc = f"{path.name}:{num}"
            bad = _LONE_SURROGATE.search(line)
            if bad:
                shown = show_text(line).rstrip("\r\n")
                yield Reject(
                    source, loc, "invalid_utf8", f"not valid {enc.name} at character {bad.start()} of the line", shown
                )
                continue
            try:
                yield loc, _decode(line, 0, whole=True)[0]
            except Malformed as exc:
                yield Reject(source, loc, "unparsable", str(exc), line.rstrip("\r\n"))


# ---------------------------------------------------------------- one JSON array


class _TextWindow:
    """A sliding window over a file's text; ``base`` is the offset (in characters) of text[0]."""

    def __init__(self, fh: TextIO):
        self.fh, self.text, self.eof, self.base = fh, "", False, 0

    def extend(self, pos: int) -> int | None:
        """Drop the text before ``pos`` and read one more chunk; the new position, or None at EOF."""
        if self.eof:
            return None
        chunk = self.fh.read(READ_CHUNK_CHARS)
        self.eof = not chunk
        # Cutting only here (not after every record) keeps slicing cost linear in the file size.
        self.text = self.text[pos:] + chunk
        self.base += pos
        return 0


def _skip_separators(window: _TextWindow, pos: int) -> int | None:
    """Position of the next record's first character (past whitespace and commas), None at EOF."""
    while True:
        while pos < len(window.text) and window.text[pos] in SEPARATORS:
            pos += 1
        if pos < len(window.text):
            return pos
        extended = window.extend(pos)
        if extended is None:
            return None
        pos = extended


def _next_record(window: _TextWindow, pos: int, keys: set[str] | None) -> tuple[int, str] | None:
    """(start, the separator before it) of the first whole record after a broken one at ``pos``; None if the
    window holds none (yet)."""
    text = window.text
    for match in _RECORD_START.finditer(text, pos + 1):
        start = match.end() - 1
        try:
            value, end = _decode(text, start, whole=False)
        except Malformed:
            continue
        if not isinstance(value, dict) or not (record_format(value) or (keys is not None and set(value) == keys)):
            continue  # a turn, or some other object nested in a record
        after = _NON_SPACE.search(text, end)
        separator = match.group()[:-1].replace("\ufeff", "")
        if after is None:
            return (start, separator) if window.eof else None  # the next chunk tells what follows
        if after.group() in ",]":
            return start, separator
    return None


def _check_record_end(text: str, end: int, value: Any) -> None:
    """Malformed unless a ',' or ']' follows the value (or the '{' of a next record after a missing comma).

    Without this, a record that lost its '{' would read as the string of its first key, then more rejects.
    """
    match = _NON_SPACE.search(text, end)
    if match is None or match.group() in ",]" or (match.group() == "{" and isinstance(value, dict)):
        return
    raise Malformed(f"invalid JSON: expected ',' or ']' after the record, found {match.group()!r}")


def _split_skipped(text: str, separator: str) -> list[str]:
    """The skipped text as one piece per record: split where the separator that precedes the next whole record
    recurs followed by a record's first character, when it holds a line break.

    JSON strings cannot hold a raw line break, so in a file with one record per line (or pretty-printed, where
    nested values are indented deeper) that separator only occurs between records. In a one-line array the
    records cannot be told apart and the skipped text stays one reject.
    """
    text = text.rstrip(SEPARATORS)
    if "\n" not in separator or "," not in separator:
        return [text]
    return re.split(re.escape(separator) + r"(?=[^\s\ufeff])", text)


def _piece(source: str, location: str, text: str) -> tuple[str, Any] | Reject:
    """One record of skipped text: its value when it decodes on its own, else an 'unparsable' reject."""
    try:
        return location, _decode(text, 0, whole=True)[0]
    except Malformed as exc:
        return Reject(source, location, "unparsable", f"{exc}; reading resumed at the next record", show_text(text))


def iter_array(source: str, path: Path, enc: TextEncoding) -> Generator[tuple[str, Any] | Reject, None, None]:
    """One JSON array, record by record (see the module doc for how a broken record is skipped)."""
    with open_text(path, enc) as fh:
        window = _TextWindow(fh)
        pos = _skip_separators(window, 0)
        assert pos is not None and window.text[pos] == "[", "the array reader was chosen for a file without '['"
        pos, index, keys = pos + 1, 0, None
        lead = window.text[pos : len(window.text) - len(window.text[pos:].lstrip(" \t\r\n"))]
        sep = "," + lead  # '[\n  {' suggests ',\n  ' between records, until two whole records show it
        while True:
            base, start = window.base, _skip_separators(window, pos)
            if start is None:
                return
            if index and window.base == base and start > pos:
                sep = window.text[pos:start].replace("\ufeff", "")  # what separates two whole records in this file
            pos = start
            if window.text[pos] == "]":
                yield from _trailing_reject(source, path, enc, window, pos + 1)
                return
            try:
                value, end = _decode(window.text, pos, whole=False)
                if end == len(window.text) and not window.eof:
                    extended = window.extend(pos)  # a number or literal may continue in the next chunk
                    assert extended is not None  # (not at EOF)
                    pos = extended
                    continue
                _check_record_end(window.text, end, value)
            except Malformed as exc:
                found = _next_record(window, pos, keys)
                if found is not None:
                    for piece in _split_skipped(window.text[pos : found[0]], found[1]):
                        yield _piece(source, f"{path.name}#[{index}]", piece)
                        index += 1
                    pos = found[0]
                    continue
                # The record continues in the next chunk, or no whole record follows it in the file.
                next_pos = window.extend(pos)
                if next_pos is None:
                    yield from _last_records(source, path, enc, window, pos, sep, index, str(exc))
                    return
                pos = next_pos
                continue
            yield f"{path.name}#[{index}]", value
            keys = set(value) if isinstance(value, dict) else keys
            index, pos = index + 1, end


def _last_records(
    source: str, path: Path, enc: TextEncoding, window: _TextWindow, pos: int, sep: str, index: int, why: str
) -> Iterator[tuple[str, Any] | Reject]:
    """The rest of an array after a broken record with no whole record behind it, split like skipped text.

    In a closed array every piece is a record; in a cut-off one the last piece is the cut-off tail.
    """
    tail = window.text[pos:]
    stripped = tail.rstrip(" \t\r\n\ufeff")
    closed = stripped.endswith("]")
    pieces = _split_skipped(stripped[:-1] if closed else tail, sep)
    for piece in pieces if closed else pieces[:-1]:
        yield _piece(source, f"{path.name}#[{index}]", piece)
        index += 1
    if not closed:
        yield _tail_reject(source, path, enc, window, pos + tail.rindex(pieces[-1]), why)


def _tail_reject(source: str, path: Path, enc: TextEncoding, window: _TextWindow, pos: int, why: str) -> Reject:
    """The undecodable rest of a JSON array as ONE reject: located by offset, head kept for reading."""
    tail = window.text[pos:]
    record: dict[str, Any] = {"head": show_text(tail[:TAIL_HEAD_CHARS]), "num_chars": len(tail)}
    if enc.name == "utf-8":
        num_bytes = len(tail.encode("utf-8", "surrogateescape"))
        record["num_bytes"] = num_bytes
        location, size = f"{path.name}@byte {path.stat().st_size - num_bytes}", f"{num_bytes:,} bytes"
    else:
        location, size = f"{path.name}@char {window.base + pos}", f"{len(tail):,} characters"
    detail = f"JSON array is cut off or broken here ({why}); no whole record follows in the remaining {size}"
    return Reject(source, location, "unparsable", detail, record)


def _trailing_reject(source: str, path: Path, enc: TextEncoding, window: _TextWindow, pos: int) -> Iterator[Reject]:
    """Text after the closing ']' is not silently ignored."""
    while (new_pos := window.extend(pos)) is not None:
        pos = new_pos
    rest = window.text[pos:].lstrip(" \t\r\n")
    if rest:
        yield _tail_reject(source, path, enc, window, len(window.text) - len(rest), "extra data after the closing ']'")
