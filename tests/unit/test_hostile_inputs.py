"""Inputs made to break the readers, the merge and the config: every record counted, one clear error, no traceback."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3.config import ConfigError, DataConfig, SourceConfig, load_config
from eagle3.data.merge import merge_sources
from eagle3.data.sources import Conversation, SourceError, read_source

DEEP = 200_000
"""Nesting depth far past Python's recursion limit (the hostile file in the report was 50 MB of it)."""


def record(num: int, key: str = "conversations") -> dict:
    if key == "messages":
        return {
            "id": f"r{num}",
            "messages": [{"role": "user", "content": f"q{num}"}, {"role": "assistant", "content": f"a{num}"}],
        }
    return {
        "id": f"r{num}",
        "conversations": [{"from": "human", "value": f"q{num}"}, {"from": "gpt", "value": f"a{num}"}],
    }


def merge(tmp_path: Path, path: Path, fmt: str = "auto", **data) -> tuple[dict, list[dict]]:
    """stats['total'] and the parsed rejects.jsonl lines (parsed strictly: NaN/Infinity are refused)."""
    paths, stats = merge_sources(
        [SourceConfig(name="s", path=str(path), format=fmt)], DataConfig(max_chars=10_000, **data), 0, tmp_path / "out"
    )
    lines = paths["rejects"].read_text(encoding="utf-8").splitlines()
    return stats["total"], [json.loads(line, parse_constant=_no_constant) for line in lines]


def _no_constant(name: str):
    raise AssertionError(f"rejects.jsonl holds {name}, which is not JSON")


def jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# ---------------------------------------------------------------- JSON arrays: one broken record


@pytest.mark.parametrize(
    "broken",
    [
        '{"id": "r5", "conversations": [{"from": "human", "value": "q"} {"from": "gpt", "value": "a"}]}',  # no comma
        '{"id": "r5", "conversations": [{"from": "human", "value": "q}, {"from": "gpt", "value": "a"}]}',  # open string
        '{"id": "r5", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]',  # no '}'
        '{"id": r5, "conversations": []}',  # bare word
    ],
)
def test_broken_record_in_an_array_is_one_reject_and_the_rest_is_read(tmp_path, broken):
    """The 6th of 100 records is broken: read 100, kept 99, one 'unparsable' reject at index [5] with its text."""
    texts = [json.dumps(record(n)) for n in range(100)]
    texts[5] = broken
    path = tmp_path / "hundred.json"
    path.write_text("[\n" + ",\n".join(texts) + "\n]\n", encoding="utf-8")
    total, rejects = merge(tmp_path, path)
    assert (total["read"], total["kept"], total["rejected"]) == (100, 99, 1)
    assert [(r["location"], r["reason"]) for r in rejects] == [("hundred.json#[5]", "unparsable")]
    assert rejects[0]["record"] == broken


# ---------------------------------------------------------------- values Python's json accepts or chokes on


def test_deeply_nested_value_is_a_reject_in_an_array_and_in_a_jsonl_line(tmp_path):
    """A record nested 200,000 deep is rejected (file, location, reason); its neighbours are kept."""
    deep = '{"id": "deep", "conversations": ' + "[" * DEEP + "]" * DEEP + "}"
    array = tmp_path / "deep.json"
    array.write_text("[" + ",".join([json.dumps(record(0)), deep, json.dumps(record(2))]) + "]", encoding="utf-8")
    lines = jsonl(tmp_path / "deep.jsonl", [json.dumps(record(0, "messages")), deep, json.dumps(record(2, "messages"))])
    for path, location in ((array, "deep.json#[1]"), (lines, "deep.jsonl:2")):
        total, rejects = merge(tmp_path, path)
        assert (total["read"], total["kept"]) == (3, 2), path
        assert [(r["location"], r["reason"]) for r in rejects] == [(location, "unparsable")]
        assert "nested deeper" in rejects[0]["detail"]


def test_a_file_that_is_one_deep_value_is_a_source_error(tmp_path):
    """A .json file holding nothing but one deeply nested array gives a SourceError, not a RecursionError."""
    path = tmp_path / "onevalue.json"
    path.write_text("[" * DEEP + "]" * DEEP, encoding="utf-8")
    with pytest.raises(SourceError, match="onevalue.json"):
        list(read_source(SourceConfig(name="s", path=str(path)), 1000))


def test_integer_id_of_5000_digits_is_a_reject_naming_the_line(tmp_path):
    """A 5,000-digit id rejects its own line (file:line, the digit count), not the whole merge."""
    huge = (
        '{"id": ' + "7" * 5000 + ', "messages": [{"role": "user", "content": "q"}, {"role": "assistant", '
        '"content": "a"}]}'
    )
    path = jsonl(tmp_path / "ids.jsonl", [json.dumps(record(0, "messages")), huge, json.dumps(record(2, "messages"))])
    total, rejects = merge(tmp_path, path)
    assert (total["read"], total["kept"], total["rejected"]) == (3, 2, 1)
    assert rejects[0]["location"] == "ids.jsonl:2" and rejects[0]["reason"] == "unparsable"
    assert "5000 digits" in rejects[0]["detail"]


def test_nan_ids_leave_rejects_jsonl_valid_json_lines(tmp_path):
    """NaN/Infinity in JSON text, and a NaN float id column in Parquet, are rejected; every rejects line is JSON."""
    texts = [
        json.dumps(record(0, "messages")),
        '{"id": NaN, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}',
        '{"id": "x", "score": -Infinity, "messages": []}',
    ]
    total, rejects = merge(tmp_path, jsonl(tmp_path / "nan.jsonl", texts))
    assert (total["read"], total["kept"]) == (3, 1)
    assert [r["location"] for r in rejects] == ["nan.jsonl:2", "nan.jsonl:3"]
    assert "NaN is not valid JSON" in rejects[0]["detail"]
    pq.write_table(
        pa.table({"id": [math.nan], "messages": [record(0, "messages")["messages"]]}), tmp_path / "nan.parquet"
    )
    paths, stats = merge_sources(
        [
            SourceConfig(name="j", path=str(tmp_path / "nan.jsonl")),
            SourceConfig(name="p", path=str(tmp_path / "nan.parquet")),
        ],
        DataConfig(dedupe=False),
        0,
        tmp_path / "out2",
    )
    lines = paths["rejects"].read_text(encoding="utf-8").splitlines()
    rejects = [json.loads(line, parse_constant=_no_constant) for line in lines]
    assert stats["total"]["read"] == 4 and rejects[-1]["location"] == "nan.parquet#row 0"
    assert rejects[-1]["record"]["id"] == "nan"


# ---------------------------------------------------------------- encodings and BOMs


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-8-sig"])
def test_utf16_and_utf32_files_read_like_utf8(tmp_path, encoding):
    """A JSONL or JSON-array file in UTF-16/32 (with or without BOM) reads to the same records as in UTF-8."""
    records = [record(n, "messages") for n in range(3)]
    records[1]["messages"][1]["content"] = "héllo ✓ 日本語 😀"
    for name, text in (
        ("x.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)),
        ("x.json", json.dumps(records, ensure_ascii=False)),
    ):
        path = tmp_path / name
        path.write_bytes(text.encode(encoding))
        items = list(read_source(SourceConfig(name="s", path=str(path)), 1000))
        assert all(isinstance(i, Conversation) for i in items), (name, items)
        assert [i.messages for i in items] == [r["messages"] for r in records]


def test_mid_file_bom_before_a_valid_line_is_read(tmp_path):
    """Two concatenated UTF-8-with-BOM files: the BOM starting line 2 does not make that record unparsable."""
    path = tmp_path / "cat.jsonl"
    path.write_bytes(
        b"\xef\xbb\xbf"
        + json.dumps(record(0, "messages")).encode()
        + b"\n"
        + b"\xef\xbb\xbf"
        + json.dumps(record(1, "messages")).encode()
        + b"\n"
    )
    items = list(read_source(SourceConfig(name="s", path=str(path)), 1000))
    assert [i.id for i in items] == ["s:r0", "s:r1"]


def test_binary_file_forced_to_a_format_fails_the_merge_loudly(tmp_path):
    """Random bytes read as sharegpt keep 0 rows: a ValueError naming data.min_rows and the reasons, no parquet."""
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(range(256)) * 40 + b"\n\x00\xff{[" * 50)
    with pytest.raises(ValueError, match=r"merge kept 0 of \d+ records read, fewer than data.min_rows=1"):
        merge(tmp_path, path, fmt="sharegpt")
    assert not (tmp_path / "out" / "merged.parquet").exists()


# ---------------------------------------------------------------- config values that become paths or shapes


@pytest.mark.parametrize(
    "override, field",
    [
        ("target.name=../../x", "target.name"),
        ("target.name=a/b", "target.name"),
        (f"run.name={'n' * 300}", "run.name"),
        ("run.name=..", "run.name"),
        ("target.tiny.hidden_size=-64", "target.tiny.hidden_size"),
        ("target.tiny.num_attention_heads=0", "target.tiny.num_attention_heads"),
        ("target.tiny.hidden_size=60", "hidden_size"),  # 60 / 4 heads = 15, an odd head size
        ("export.checkpoint=../../elsewhere", "export.checkpoint"),
    ],
)
def test_unsafe_names_and_impossible_shapes_are_config_errors(override, field):
    """Names with separators or '..', over-long names, non-positive or inconsistent sizes: a ConfigError naming them."""
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config("tiny", [override])


def test_workdir_that_is_a_file_is_a_config_error(tmp_path):
    """run.workdir pointing at a file (or below one) is refused before anything is created."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for workdir in (afile, afile / "sub"):
        with pytest.raises(ConfigError, match="run.workdir.*is a file, not a folder"):
            load_config("tiny", [f"run.workdir={workdir}"])


# ---------------------------------------------------------------- one huge line of binary bytes

_MERGE_PEAK = """
import json, resource, sys
from pathlib import Path
from eagle3.config import DataConfig, SourceConfig
from eagle3.data.merge import merge_sources
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
paths, stats = merge_sources([SourceConfig(name="s", path=sys.argv[1])], DataConfig(max_chars=10_000), 0,
                             Path(sys.argv[2]))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grew": (peak - before) * 1024, "rejects": str(paths["rejects"]), "total": stats["total"]}))
"""


def test_a_huge_binary_line_costs_a_small_multiple_of_its_size_and_a_bounded_reject(tmp_path):
    """A 24 MB line of random bytes in a JSONL source: the merge's peak memory grows by < 5x the line (it was
    ~57x), and its reject holds a bounded excerpt (< 64 KB) with the line's location, byte offset, size and the
    sha256 of its bytes instead of an escaped copy (it was ~3x the line)."""
    import hashlib
    import os
    import subprocess
    import sys

    size = 24 << 20
    line = os.urandom(size).replace(b"\n", b"x")
    first = json.dumps(record(0, "messages")).encode() + b"\n"
    path = tmp_path / "bin.jsonl"
    path.write_bytes(first + line + b"\n" + json.dumps(record(2, "messages")).encode() + b"\n")
    out = subprocess.run(
        [sys.executable, "-c", _MERGE_PEAK, str(path), str(tmp_path / "out")],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert (result["total"]["read"], result["total"]["kept"]) == (3, 2)
    assert result["grew"] < 5 * size, f"peak grew by {result['grew'] / size:.1f}x the line"
    rejects = Path(result["rejects"])
    assert rejects.stat().st_size < 64 << 10
    # JSONL records end at "\n" only: str.splitlines also splits at U+2028 or U+0085, which a reject written with
    # ensure_ascii=False keeps raw (random bytes decode to them now and then)
    (reject,) = [json.loads(text) for text in rejects.read_text(encoding="utf-8").split("\n") if text]
    assert (reject["location"], reject["reason"]) == ("bin.jsonl:2", "invalid_utf8")
    assert reject["offset"] == len(first) and reject["size"] == size
    assert reject["sha256"] == hashlib.sha256(line).hexdigest()
    assert reject["record_truncated"] is True and len(reject["record"]) <= 20_000
