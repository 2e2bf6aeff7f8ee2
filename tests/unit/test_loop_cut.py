"""Runaway loops: where textcheck.loop_cut cuts, and what regenerate.cut_loops keeps of a conversation."""

from __future__ import annotations

import pytest

from eagle3.config import RegenerateConfig
from eagle3.data.regenerate import regenerate
from eagle3.data.textcheck import LOOP_KEEP_WORDS, LOOP_WORD_RE, loop_cut
from tests.fakes.openai_server import FakeOpenAIServer
from tests.unit.test_regenerate import _backend, _cfg, _conv, _read_out, _write_merged

PREFIX = "Paris is the capital of France and a city of art. "
LOOP = "I went to the market and bought fresh bread. "


def _word_starts(text: str) -> list[int]:
    return [m.start() for m in LOOP_WORD_RE.finditer(text)]


def test_cut_keeps_the_clean_prefix_and_a_few_words_of_the_loop():
    """The cut falls LOOP_KEEP_WORDS words after the first repeated 3-gram (the loop's second pass)."""
    text = PREFIX + LOOP * 30
    loop_start_word = len(LOOP_WORD_RE.findall(PREFIX + LOOP))  # "i went to" repeats here
    assert loop_cut(text) == _word_starts(text)[loop_start_word + LOOP_KEEP_WORDS]


@pytest.mark.parametrize(
    "text",
    [
        "Intro. " + "".join(f"{i}. The Earth is about 150 million kilometers from the Sun. " for i in range(1, 40)),
        "回答：" + "请检查逻辑是否有误，是否符合设计的功能？" * 20,
    ],
    ids=["numbered-lines", "cjk"],
)
def test_numbered_and_cjk_loops_are_found(text):
    """Changing line numbers do not hide a loop, and CJK text (no spaces) is read a character at a time."""
    cut = loop_cut(text)
    assert cut is not None and len(text[:cut]) < len(text) // 3


@pytest.mark.parametrize(
    "text",
    [
        PREFIX * 1 + "Then we walked along the river, ate dinner, saw a play and took the late train home.",
        PREFIX + "The list ends with: " + "x y z " * 3,  # a repetitive tail shorter than LOOP_TAIL_MIN_WORDS
        " ".join(f"item {w} costs more than item {w}x" for w in "abcdefghijklmnopqrstuvwxyz"),  # repeats < 90%
    ],
    ids=["clean", "short-tail", "varied-list"],
)
def test_text_without_a_runaway_loop_is_not_cut(text):
    """Clean text, a short repetitive ending and a list whose lines differ keep every word."""
    assert loop_cut(text) is None


def test_cut_loops_cuts_capped_answers_drops_later_turns_and_regenerates_nothing(tmp_path):
    """With cut_loops a capped looping answer is cut (still truncated) and the turns after it go; an answer that
    loops but stopped by itself stays whole; turning it on or off rebuilds the output from the journal alone."""
    rows = [_conv(0, num_turns=3), _conv(1, num_turns=1), _conv(2, num_turns=1)]
    rows[0]["messages"][3]["content"] += " " + LOOP * 20 + " CUT"  # its second answer echoes the loop, capped
    rows[1]["messages"][1]["content"] += " " + LOOP * 20  # loops, but finishes with "stop"
    src = _write_merged(tmp_path / "merged.parquet", rows)
    with FakeOpenAIServer(length_marker="CUT") as server:
        plain, plain_stats = regenerate(src, tmp_path / "out", _cfg(server), _backend(_cfg(server)))
    whole = _read_out(plain)[0]
    cfg = RegenerateConfig(**{**_cfg(server).model_dump(), "cut_loops": True})
    paths, stats = regenerate(src, tmp_path / "out", cfg, _backend(cfg))  # the server is closed: journal only
    cut = _read_out(paths)[0]
    assert [len(r["messages"]) for r in whole] == [7, 3, 3] and whole[0]["truncated_turns"] == [4]
    assert [len(r["messages"]) for r in cut] == [5, 3, 3] and cut[0]["truncated_turns"] == [4]
    answer, full = cut[0]["messages"][4]["content"], whole[0]["messages"][4]["content"]
    assert full.startswith(answer) and LOOP in answer and len(answer) < len(full) // 4
    assert cut[1:] == whole[1:]
    assert stats["loop_cuts"] == {"answers": 1, "chars_removed": len(full) - len(answer), "later_turns_dropped": 1}
    assert "loop_cuts" not in plain_stats


def test_loop_stop_changes_the_journal_key_only_once_set(tmp_path):
    """loop_stop_tokens changes answers, so once set it is in the journal's settings key (those rows are answered
    again); at 0 the key is the one journals had before the setting existed; continuous batching refuses it."""
    from eagle3.data.regenerate import settings_key

    base = RegenerateConfig()
    assert settings_key(base) == settings_key(base.model_copy(update={"cut_loops": True}))  # a post-process only
    assert settings_key(base) != settings_key(RegenerateConfig(loop_stop_tokens=64))
    with pytest.raises(ValueError, match="loop_stop_tokens needs generation_backend"):
        RegenerateConfig(loop_stop_tokens=64, generation_backend="continuous")
