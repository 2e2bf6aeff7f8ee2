"""Reading a synthetic source in the merge: the records the synthesize stage wrote, checked and filtered.

The synthesize stage (eagle3.data.synthesize) writes every record it generated to
``<run>/data/synthetic/<name>.jsonl``, one JSON object a line:

    {"id": "17", "messages": [{"role": "user", ...}, {"role": "assistant", ...}],
     "finish_reasons": {"prompt": "stop", "answer": "length"}, "generation": {"seed": ..., ...}}

A prompt that came back empty or truncated is not answered (its record has only the user turn).
The merge reads the file like an OpenAI 'messages' source and rejects, with these reasons, in this order:

    empty_turn        the user turn or the answer is empty (whitespace only)
    truncated         the user turn or the answer hit its token cap without an end-of-turn token
    (the reader's own reasons: unparsable, too_long, ...)
    degenerate        a turn is mostly not letters or digits, or loops (eagle3.data.textcheck)
    duplicate_prompt  the same user turn (normalized words) as an earlier kept record
    near_duplicate    the user turn's word 3-gram Jaccard similarity to an earlier kept one >= synthetic.near_duplicate

so every generated record is either a row or a reject, counted in stats.json like any source's.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any

from eagle3.config import CharsOf, SourceConfig
from eagle3.config_base import ConfigError
from eagle3.data.containers import detect_encoding, iter_lines
from eagle3.data.rejects import Reject, SourceError
from eagle3.data.sources import SOURCE_NAME_RE, Conversation, SourceStream, make_row_id, normalize_records
from eagle3.data.textcheck import NearDuplicates, degenerate_reason, words

SYNTHETIC_DIR = "synthetic"
RECORDS_SUFFIX, JOURNAL_SUFFIX = ".jsonl", ".journal.jsonl"
"""data/synthetic/<name>.jsonl holds a source's records, <name>.journal.jsonl the synthesize stage's journal."""


def synthetic_path(data_dir: Path, name: str) -> Path:
    """The file the synthesize stage writes for a synthetic source (the merge reads it)."""
    if not SOURCE_NAME_RE.fullmatch(name):
        raise SourceError(f"source name {name!r}: use only letters, digits, '-', '_' and '.'")
    return Path(data_dir) / SYNTHETIC_DIR / f"{name}{RECORDS_SUFFIX}"


def synthetic_journal_path(data_dir: Path, name: str) -> Path:
    """The synthesize stage's journal of a synthetic source, beside its records file."""
    return synthetic_path(data_dir, name).with_name(f"{name}{JOURNAL_SUFFIX}")


def check_file_names(sources: list[SourceConfig]) -> None:
    """ConfigError naming both sources when two synthetic sources would write one file: 'x' journals into
    x.journal.jsonl, the records file of a source 'x.journal' (and two sources of one name share everything)."""
    owner: dict[str, tuple[int, str]] = {}  # file name -> (index, name) of the source that writes it
    for index, src in enumerate(sources):
        if src.format != "synthetic":
            continue
        for path in (synthetic_path(Path(), src.name), synthetic_journal_path(Path(), src.name)):
            first = owner.setdefault(path.name, (index, src.name))
            if first[0] != index:
                raise ConfigError(
                    f"data.sources: synthetic sources {first[1]!r} and {src.name!r} would both write "
                    f"data/{SYNTHETIC_DIR}/{path.name}; rename one of them"
                )


def read_synthetic(src: SourceConfig, data_dir: Path, max_chars: int, chars_of: CharsOf = "all") -> SourceStream:
    """Every generated record of a synthetic source, in index order, as Conversation or Reject."""
    assert src.synthetic is not None, "SourceConfig fills synthetic for format synthetic"
    path = synthetic_path(data_dir, src.name)
    if not path.is_file():
        raise SourceError(f"source {src.name!r}: {path} does not exist; run the synthesize stage first")
    raw = iter_lines(src.name, path, detect_encoding(path))
    items = normalize_records(src.name, "openai", _check_generation(src.name, raw), max_chars, chars_of)
    return SourceStream("synthetic", path, _filter(items, src.synthetic.near_duplicate), raw)


def _generation_problem(record: Any) -> tuple[str, str] | None:
    """(reason, detail) for a record whose prompt or answer is empty or truncated, else None."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        return None  # the openai reader rejects it as unparsable
    finish = record.get("finish_reasons") or {}
    turns = {m.get("role"): m.get("content") for m in record["messages"] if isinstance(m, dict)}
    for role, part in (("user", "prompt"), ("assistant", "answer")):
        content = turns.get(role)
        empty = content is None or (isinstance(content, str) and not content.strip())
        if empty and (role == "user" or finish.get("prompt") == "stop"):  # an unanswered prompt: its own reason
            return "empty_turn", f"the generated {part} is empty"
        if finish.get(part) == "length":
            return "truncated", f"the generated {part} hit its token cap without an end-of-turn token"
    return None


def _check_generation(source: str, raw: Generator[Any, None, None]) -> Generator[Any, None, None]:
    """The raw (location, record) items, with empty or truncated generations turned into Rejects."""
    try:
        for item in raw:
            problem = None if isinstance(item, Reject) else _generation_problem(item[1])
            if problem is None:
                yield item
                continue
            loc, record = item
            yield Reject(source, loc, problem[0], problem[1], record, make_row_id(source, str(record.get("id"))))
    finally:
        raw.close()


def _filter(
    items: Generator[Conversation | Reject, None, None], near_threshold: float
) -> Generator[Conversation | Reject, None, None]:
    """Degenerate, repeated and near-duplicate conversations become Rejects; kept prompts are remembered."""
    seen: dict[tuple[str, ...], str] = {}  # normalized prompt words -> id of the kept record
    near = NearDuplicates(near_threshold)
    try:
        for item in items:
            if isinstance(item, Reject):
                yield item
                continue
            prompt = "\n".join(m["content"] for m in item.messages if m["role"] == "user")
            problem = _repeat_or_degenerate(item, prompt, seen, near)
            if problem is not None:
                yield Reject(
                    item.source,
                    item.location,
                    problem[0],
                    problem[1],
                    {"id": item.id, "messages": item.messages},
                    item.id,
                )
                continue
            seen[tuple(words(prompt))] = item.id
            near.add(prompt, item.id)
            yield item
    finally:
        items.close()


def _repeat_or_degenerate(
    conv: Conversation, prompt: str, seen: dict[tuple[str, ...], str], near: NearDuplicates
) -> tuple[str, str] | None:
    for msg in conv.messages:
        why = degenerate_reason(msg["content"])
        if why:
            return "degenerate", f"the {msg['role']} turn: {why}"
    first = seen.get(tuple(words(prompt)))
    if first is not None:
        return "duplicate_prompt", f"the same user turn as {first}"
    match = near.find(prompt)
    if match is not None:
        return "near_duplicate", f"user turn's word 3-gram Jaccard similarity {match[1]:.2f} to {match[0]}"
    return None
