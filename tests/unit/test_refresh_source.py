"""The refresh prompt source: every complete line taken exactly once behind the journaled watermark, a file changed
under it refused, records turned into merge input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.refresh.source import PromptSource, SourceChangedError, to_record


def _take(source: PromptSource, round_id: str, max_lines: int | None = None) -> list[bytes]:
    """Read past the watermark and commit it as round ``round_id``; the lines taken."""
    new = source.read_new(max_lines)
    if new.spans:
        source.commit(round_id, new, "sha")
    return new.lines


def test_a_growing_file_gives_each_complete_line_once_and_a_partial_line_later(tmp_path):
    """Appends after a read come in the next read; a line without its newline waits until it is complete."""
    prompts = tmp_path / "traffic.jsonl"
    prompts.write_bytes(b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c')
    source = PromptSource(prompts, tmp_path / "state" / "watermark.jsonl")
    assert _take(source, "0001") == [b'{"prompt": "a"}', b'{"prompt": "b"}']
    assert _take(source, "0002") == []  # only the unfinished line
    with open(prompts, "ab") as fh:
        fh.write(b'"}\n\n{"prompt": "d"}\n')
    assert _take(source, "0002") == [b'{"prompt": "c"}', b'{"prompt": "d"}']  # the blank line is taken, not kept
    assert _take(source, "0003") == []
    spans = [s for r in source.records() for s in r["spans"]]
    assert [(s["start"], s["end"]) for s in spans] == [(0, 32), (32, prompts.stat().st_size)]  # contiguous


def test_a_folder_is_read_in_name_order_and_new_files_are_picked_up(tmp_path):
    """Files of a folder are read by name; a file added later is read from its start, the old ones from their mark."""
    folder = tmp_path / "new"
    folder.mkdir()
    (folder / "b.jsonl").write_bytes(b"b1\n")
    (folder / "a.jsonl").write_bytes(b"a1\na2\n")
    (folder / ".hidden.jsonl").write_bytes(b"x\n")
    (folder / "notes.txt").write_bytes(b"x\n")
    source = PromptSource(folder, tmp_path / "watermark.jsonl")
    assert _take(source, "0001") == [b"a1", b"a2", b"b1"]
    (folder / "c.jsonl").write_bytes(b"c1\n")
    with open(folder / "a.jsonl", "ab") as fh:
        fh.write(b"a3\n")
    assert _take(source, "0002") == [b"a3", b"c1"]


def test_max_lines_leaves_the_rest_for_the_next_round(tmp_path):
    """A capped read stops mid-file at a line boundary; the next read continues exactly there."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b"".join(f"{i}\n".encode() for i in range(7)))
    source = PromptSource(prompts, tmp_path / "w.jsonl")
    rounds = [_take(source, f"{n:04d}", max_lines=3) for n in range(1, 5)]
    assert rounds == [[b"0", b"1", b"2"], [b"3", b"4", b"5"], [b"6"], []]


def test_lines_read_but_not_committed_are_read_again_and_committed_ones_never(tmp_path):
    """A crash before the watermark record re-reads the same lines; after it, nothing is re-read, also in a new
    PromptSource over the same journal (a new process)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b"1\n2\n")
    state = tmp_path / "w.jsonl"
    assert PromptSource(prompts, state).read_new().lines == [b"1", b"2"]  # read, then "killed" before commit
    assert _take(PromptSource(prompts, state), "0001") == [b"1", b"2"]
    assert PromptSource(prompts, state).read_new().lines == []


@pytest.mark.parametrize("change", ["truncate", "rewrite"])
def test_a_file_changed_under_its_watermark_is_refused(tmp_path, change):
    """Bytes a refresh already took that shrink or change stop the read with the file named."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b"alpha\nbeta\n")
    source = PromptSource(prompts, tmp_path / "w.jsonl")
    _take(source, "0001")
    prompts.write_bytes(b"alpha\n" if change == "truncate" else b"ALPHA\nbeta\ngamma\n")
    with pytest.raises(SourceChangedError, match="p.jsonl"):
        source.read_new()


def test_records_become_openai_messages_and_unknown_lines_pass_through():
    """A bare prompt becomes a user turn (plus an empty answer to regenerate), ShareGPT turns become messages, a
    line the merge must judge stays byte for byte."""
    assert json.loads(to_record(b'{"prompt": "hi", "id": 7}', True)) == {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}],
        "id": 7,
    }
    assert json.loads(to_record(b'{"prompt": "hi"}', False)) == {"messages": [{"role": "user", "content": "hi"}]}
    sharegpt = b'{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}'
    assert json.loads(to_record(sharegpt, True)) == {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    }
    for raw in (b"not json", b"[1, 2]", b'{"text": "no turns"}'):
        assert to_record(raw, True) == raw


def test_a_missing_source_is_named(tmp_path):
    """A prompt source that does not exist is an error naming it."""
    with pytest.raises(FileNotFoundError, match="nowhere"):
        PromptSource(Path(tmp_path / "nowhere"), tmp_path / "w.jsonl").read_new()
