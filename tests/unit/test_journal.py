"""The journal's promise: a torn last line (a kill mid-write) is ignored, at any byte boundary, also inside a
multi-byte UTF-8 character, by every reader of the synthesize, regenerate and evaluate journals."""

from __future__ import annotations

import json

from eagle3.data.regenerate import slice_journal_path
from eagle3.data.regenerate_slices import AnsweredCounter
from eagle3.run.journal import Journal

GOOD = [{"id": "a", "text": "Crème brûlée"}, {"id": "b", "text": "日本語 \u2028 line sep"}]
TORN = {"id": "c", "text": "naïve 🙂 ünïcödé 漢字"}


def _cuts() -> list[bytes]:
    """Every proper prefix of the torn record's line (cuts inside each multi-byte character among them)."""
    line = (json.dumps(TORN, ensure_ascii=False) + "\n").encode("utf-8")
    return [line[:n] for n in range(1, len(line) - 1)]


def test_a_torn_last_line_is_ignored_at_every_byte_boundary(tmp_path):
    """Journal.load (synthesize, regenerate and its slices, evaluate all read through it) skips a last line cut
    at any byte, and the next append starts a fresh line that loads."""
    cuts = _cuts()
    assert any(not _decodes(cut) for cut in cuts)  # some cuts end inside a character
    for n, cut in enumerate(cuts):
        journal = Journal(tmp_path / f"j{n}.jsonl")
        journal.extend(GOOD)
        with open(journal.path, "ab") as fh:
            fh.write(cut)
        assert list(journal.load()) == ["a", "b"], cut
        with journal.appender() as append:
            append(TORN)
        assert journal.load()["c"] == TORN and journal.load()["b"] == GOOD[1]


def test_the_slice_progress_counter_skips_a_torn_line_at_every_byte_boundary(tmp_path):
    """AnsweredCounter (regeneration's progress over slice journals, read as bytes) counts only whole records."""
    for n, cut in enumerate(_cuts()):
        out = tmp_path / str(n)
        journal = Journal(slice_journal_path(out, 0))
        journal.extend([*GOOD, TORN])
        data = journal.path.read_bytes()
        journal.path.write_bytes(data[: data.index(b'{"id": "c"')] + cut)
        counter = AnsweredCounter(out, ["a", "b", "c"])
        assert counter() == 2, cut


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
