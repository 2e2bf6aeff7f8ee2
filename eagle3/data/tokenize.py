"""Render conversations with the target's own chat template and build the assistant loss mask.

The mask is derived from the rendering itself, not from template-specific markers: for every
assistant turn i we render ``messages[:i]`` with the generation prompt and ``messages[:i+1]``
without, and the characters in between (up to and including the end-of-turn text) are what the
model produces for that turn. This works for templates with no ``{% generation %}`` markers
(SmolLM2's ChatML) and fails loudly for templates that rewrite earlier turns (e.g. thinking
templates that strip reasoning from history), where such a diff would point at the wrong text.

The full text is tokenized once (``add_special_tokens=False``: the template already emits the
specials) and a token is supervised iff its character span overlaps a supervised span.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle3.config import TokenizeConfig
from eagle3.run.layout import TOKENIZED_FILE
from eagle3.run.progress import Progress, ProgressFn
from infra.storage import atomic_path, atomic_write_text

Message = dict[str, str]
Span = tuple[int, int]
"""Half-open character range [start, end) of the rendered text."""

PROBE_MARKER = "EAGLE3_PROBE_END_OF_TURN_7f3a"
"""Unique assistant content used to find what the template writes after an assistant turn."""
CHUNK_ROWS = 512
"""Rows rendered, then tokenized in one batch call (the Rust side parallelizes across the batch)."""
REJECT_REASONS = ("template_error", "overlong", "too_few_loss_tokens")
TRUNCATED_TURNS = "truncated_turns"
"""Optional input column (regeneration writes it): list<int32> indices of the assistant messages the target did
not finish (cut at the token cap). Their content is supervised; their end-of-turn text, which the template wrote
and the target never produced, is not."""

TOKENIZED_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("split", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("num_tokens", pa.int32()),
        ("num_loss_tokens", pa.int32()),
        ("truncated", pa.bool_()),
    ]
)


class EmptyTokenizeError(ValueError):
    """Tokenize had no rows to read, or rejected every row: nothing a drafter could learn from."""


class TemplateError(ValueError):
    """The chat template cannot give a trustworthy loss mask for this conversation."""

    def __init__(self, row_id: str, problem: str):
        super().__init__(f"conversation {row_id}: {problem}")
        self.row_id, self.problem = row_id, problem


def _render(tokenizer: Any, messages: Sequence[Message], row_id: str, add_generation_prompt: bool = False) -> str:
    """The template's text for ``messages``; any template failure becomes a TemplateError naming the row."""
    try:
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:  # jinja raises many types (incl. raise_exception from the template)
        raise TemplateError(row_id, f"chat template failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(text, str):
        raise TemplateError(row_id, f"chat template returned {type(text).__name__}, expected str")
    return text


def end_of_turn_text(tokenizer: Any) -> str:
    """What the template writes right after an assistant turn's content (ChatML '<|im_end|>', Llama 3 '<|eot_id|>')."""
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": PROBE_MARKER}]
    text = _render(tokenizer, probe, "<end-of-turn probe>")
    at = text.find(PROBE_MARKER)
    if at < 0:
        raise TemplateError("<end-of-turn probe>", "the chat template dropped the final assistant content")
    # Skip whitespace the template may put between content and the closing token, then take one run.
    match = re.match(r"\s*(\S+)", text[at + len(PROBE_MARKER) :])
    if match is None:
        raise TemplateError(
            "<end-of-turn probe>",
            "the chat template writes nothing after assistant content, "
            "so the end of an assistant turn cannot be supervised",
        )
    return match.group(1)


def _trim_trailing_turns(messages: Sequence[Message]) -> list[Message]:
    """Drop turns after the last assistant turn: nothing after them is supervised, capturing them is wasted work."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    return list(messages[: last + 1]) if last >= 0 else list(messages)


def _check_prefix(shorter: str, longer: str, row_id: str, what: str) -> None:
    if not longer.startswith(shorter):
        at = next((i for i, (a, b) in enumerate(zip(shorter, longer)) if a != b), min(len(shorter), len(longer)))
        raise TemplateError(
            row_id,
            f"{what}: the chat template rewrites earlier text (renderings differ at char {at}: "
            f"{shorter[at : at + 40]!r} vs {longer[at : at + 40]!r}); thinking/tool templates that edit history "
            "are not supported, because the loss mask would point at the wrong tokens",
        )


def _turn_span(prompt: str, turn: str, end_of_turn: str, row_id: str, index: int, finished: bool = True) -> Span:
    """From the end of the generation prompt to the end of the last end-of-turn text inside the turn's diff (to its
    start for a turn the model did not finish)."""
    diff = turn[len(prompt) :]
    # rfind: the template's closing token comes after the content, even if the content quotes it.
    at = diff.rfind(end_of_turn)
    if at < 0:
        raise TemplateError(
            row_id, f"assistant turn {index}: end-of-turn text {end_of_turn!r} not found in its rendering"
        )
    return len(prompt), len(prompt) + at + (len(end_of_turn) if finished else 0)


def supervised_spans(
    tokenizer: Any,
    messages: Sequence[Message],
    row_id: str = "?",
    end_of_turn: str | None = None,
    unfinished: Sequence[int] = (),
) -> tuple[str, list[Span]]:
    """The rendered conversation and the char spans of each assistant turn's content + end-of-turn text (content
    only for the message indices in ``unfinished``: turns cut at the token cap)."""
    end_of_turn = end_of_turn or end_of_turn_text(tokenizer)
    messages = _trim_trailing_turns(messages)
    full = _render(tokenizer, messages, row_id)
    spans: list[Span] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:  # chat templates cannot render the empty prompt this turn would be generated from
            raise TemplateError(row_id, "the conversation starts with an assistant turn, which has no prompt")
        prompt = _render(tokenizer, messages[:i], row_id, add_generation_prompt=True)
        turn = full if i == len(messages) - 1 else _render(tokenizer, messages[: i + 1], row_id)
        _check_prefix(prompt, turn, row_id, f"assistant turn {i} vs its generation prompt")
        _check_prefix(turn, full, row_id, f"assistant turn {i} vs the full conversation")
        spans.append(_turn_span(prompt, turn, end_of_turn, row_id, i, finished=i not in unfinished))
    return full, spans


def mask_from_offsets(offsets: np.ndarray, spans: Sequence[Span]) -> np.ndarray:
    """uint8 [T]: 1 where a token's char range overlaps a supervised span. offsets: int [T, 2]."""
    mask = np.zeros(len(offsets), dtype=bool)
    starts, ends = offsets[:, 0], offsets[:, 1]
    for lo, hi in spans:
        mask |= (starts < hi) & (ends > lo)
    return mask.astype(np.uint8)


def masked_runs(tokenizer: Any, input_ids: Sequence[int], loss_mask: Sequence[int]) -> list[tuple[int, str]]:
    """Consecutive (mask value, decoded text) runs: a readable view of what is supervised."""
    runs: list[tuple[int, list[int]]] = []
    for tok, bit in zip(input_ids, loss_mask):
        if runs and runs[-1][0] == int(bit):
            runs[-1][1].append(int(tok))
        else:
            runs.append((int(bit), [int(tok)]))
    return [(bit, tokenizer.decode(ids, skip_special_tokens=False)) for bit, ids in runs]


def mask_view(tokenizer: Any, input_ids: Sequence[int], loss_mask: Sequence[int]) -> str:
    """The decoded sample with supervised runs wrapped in ⟦ ⟧, for golden files and debugging."""
    return "".join(f"⟦{text}⟧" if bit else text for bit, text in masked_runs(tokenizer, input_ids, loss_mask))


def render_with_mask(
    tokenizer: Any, messages: Sequence[Message], row_id: str = "?", end_of_turn: str | None = None
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) for one conversation, rendered with the tokenizer's own chat template."""
    text, spans = supervised_spans(tokenizer, messages, row_id, end_of_turn)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)  # [T, 2]
    return list(enc["input_ids"]), mask_from_offsets(offsets, spans).tolist()


@dataclass
class _Tally:
    """Counters for stats; the invariant written + sum(rejected) == rows_in is checked at the end."""

    rows_in: int = 0
    rows_written: int = 0
    rows_truncated: int = 0
    rejected: Counter = field(default_factory=Counter)
    num_tokens: int = 0
    num_loss_tokens: int = 0
    num_tokens_cut: int = 0
    # turns cut at the token cap in rendered rows (rejected ones too): end-of-turn unsupervised
    unfinished_turns: int = 0
    render_s: float = 0.0
    tokenize_s: float = 0.0


@dataclass
class _Chunk:
    """Accepted samples of one chunk, as flat arrays ready for Arrow list columns."""

    ids: list[str] = field(default_factory=list)
    splits: list[str] = field(default_factory=list)
    input_ids: list[np.ndarray] = field(default_factory=list)
    loss_masks: list[np.ndarray] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)


def _reject(rejects: list[dict], tally: _Tally, row_id: str, reason: str, detail: str) -> None:
    rejects.append({"id": row_id, "reason": reason, "detail": detail})
    tally.rejected[reason] += 1


def _apply_length_policy(
    ids: np.ndarray, mask: np.ndarray, cfg: TokenizeConfig
) -> tuple[np.ndarray, np.ndarray, bool] | tuple[str, str]:
    """(ids, mask, truncated) after the overlong and min-loss policies, or (reject reason, detail)."""
    num_tokens = len(ids)
    truncated = num_tokens > cfg.max_len
    if truncated:
        if cfg.overlong == "drop":
            return "overlong", f"{num_tokens} tokens > max_len {cfg.max_len}"
        ids, mask = ids[: cfg.max_len], mask[: cfg.max_len]
    num_loss = int(mask.sum())
    if num_loss < cfg.min_loss_tokens:
        where = f"after truncation to {cfg.max_len} of {num_tokens} tokens" if truncated else f"in {num_tokens} tokens"
        return "too_few_loss_tokens", f"{num_loss} loss tokens {where} < min_loss_tokens {cfg.min_loss_tokens}"
    return ids, mask, truncated


def _render_rows(
    rows: list[dict], tokenizer: Any, end_of_turn: str, rejects: list[dict], tally: _Tally
) -> tuple[list[dict], list[str], list[list[Span]]]:
    """Render each row; template failures are rejected here so the batch tokenizer sees only good texts."""
    kept, texts, spans = [], [], []
    for row in rows:
        try:
            unfinished = row.get(TRUNCATED_TURNS) or ()
            text, row_spans = supervised_spans(tokenizer, row["messages"], row["id"], end_of_turn, unfinished)
            tally.unfinished_turns += len(unfinished)
        except TemplateError as exc:
            _reject(rejects, tally, row["id"], "template_error", str(exc))
            continue
        kept.append(row)
        texts.append(text)
        spans.append(row_spans)
    return kept, texts, spans


def _batch_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer behind ``tokenizer`` with truncation and padding off (the policy is ours, not the file's)."""
    backend = tokenizer.backend_tokenizer
    if backend.truncation is None and backend.padding is None:
        return backend
    backend = copy.deepcopy(backend)
    backend.no_truncation()
    backend.no_padding()
    return backend


def encode_batch(tokenizer: Any, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids int32 [T], char offsets int64 [T, 2]) per text, like tokenizer(texts, add_special_tokens=False).

    Calls the Rust batch encoder directly: it parallelizes over the batch, and skipping the
    BatchEncoding wrapper (attention masks, per-key Python lists) roughly halves the time.
    """
    out = []
    for enc in _batch_backend(tokenizer).encode_batch(texts, add_special_tokens=False):
        ids = np.asarray(enc.ids, dtype=np.int32)  # [T]
        flat = np.fromiter(itertools.chain.from_iterable(enc.offsets), dtype=np.int64, count=2 * len(ids))
        out.append((ids, flat.reshape(-1, 2)))  # [T, 2]
    return out


def _tokenize_chunk(
    rows: list[dict], tokenizer: Any, cfg: TokenizeConfig, end_of_turn: str, rejects: list[dict], tally: _Tally
) -> _Chunk:
    """Render, batch-tokenize and mask one chunk of rows, applying the length policies."""
    start = time.perf_counter()
    kept, texts, spans = _render_rows(rows, tokenizer, end_of_turn, rejects, tally)
    mid = time.perf_counter()
    chunk = _Chunk()
    for row, row_spans, (ids, offsets) in zip(kept, spans, encode_batch(tokenizer, texts)):
        outcome = _apply_length_policy(ids, mask_from_offsets(offsets, row_spans), cfg)
        if len(outcome) == 2:
            _reject(rejects, tally, row["id"], *outcome)
            continue
        _add_sample(chunk, tally, row, *outcome, num_tokens_before=len(ids))
    tally.render_s += mid - start
    tally.tokenize_s += time.perf_counter() - mid
    return chunk


def _add_sample(
    chunk: _Chunk, tally: _Tally, row: dict, ids: np.ndarray, mask: np.ndarray, truncated: bool, num_tokens_before: int
) -> None:
    chunk.ids.append(row["id"])
    chunk.splits.append(row["split"])
    chunk.input_ids.append(ids)
    chunk.loss_masks.append(mask)
    chunk.truncated.append(truncated)
    tally.rows_written += 1
    tally.rows_truncated += int(truncated)
    tally.num_tokens += len(ids)
    tally.num_loss_tokens += int(mask.sum())
    tally.num_tokens_cut += num_tokens_before - len(ids)


def _list_array(parts: list[np.ndarray], value_type: pa.DataType) -> pa.Array:
    """Arrow list column from per-row numpy arrays, built from one flat buffer (no per-element Python objects)."""
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    dtype = value_type.to_pandas_dtype()
    values = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def _chunk_table(chunk: _Chunk) -> pa.Table:
    num_tokens = np.fromiter((len(p) for p in chunk.input_ids), dtype=np.int32, count=len(chunk.ids))
    num_loss = np.fromiter((int(m.sum()) for m in chunk.loss_masks), dtype=np.int32, count=len(chunk.ids))
    return pa.Table.from_arrays(
        [
            pa.array(chunk.ids, pa.string()),
            pa.array(chunk.splits, pa.string()),
            _list_array(chunk.input_ids, pa.int32()),
            _list_array(chunk.loss_masks, pa.uint8()),
            pa.array(num_tokens, pa.int32()),
            pa.array(num_loss, pa.int32()),
            pa.array(chunk.truncated, pa.bool_()),
        ],
        schema=TOKENIZED_SCHEMA,
    )


def _stats(tally: _Tally, elapsed_s: float, end_of_turn: str) -> dict[str, Any]:
    num_rejected = sum(tally.rejected.values())
    if tally.rows_written + num_rejected != tally.rows_in:
        raise AssertionError(
            f"tokenize lost rows: {tally.rows_written} written + {num_rejected} rejected != {tally.rows_in} in"
        )
    elapsed_s = max(elapsed_s, 1e-9)
    return {
        "rows_in": tally.rows_in,
        "rows_written": tally.rows_written,
        "rows_truncated": tally.rows_truncated,
        "rows_rejected": num_rejected,
        "rejected_by_reason": {r: tally.rejected[r] for r in REJECT_REASONS},
        "num_tokens": tally.num_tokens,
        "num_loss_tokens": tally.num_loss_tokens,
        "num_tokens_cut": tally.num_tokens_cut,
        "end_of_turn_text": end_of_turn,
        "unfinished_turns": tally.unfinished_turns,
        "elapsed_s": round(elapsed_s, 3),
        "render_s": round(tally.render_s, 3),
        "tokenize_s": round(tally.tokenize_s, 3),
        "rows_per_s": round(tally.rows_in / elapsed_s, 1),
        "tokens_per_s": round(tally.num_tokens / elapsed_s, 1),
    }


def _write_rejects(path: Path, rejects: list[dict]) -> Path:
    text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rejects)
    return atomic_write_text(path, text)


def _check_not_empty(tally: _Tally, in_parquet: Path, rejects_path: Path) -> None:
    if tally.rows_written == 0:
        reasons = ", ".join(f"{reason} {num:,}" for reason, num in tally.rejected.most_common() if num)
        raise EmptyTokenizeError(
            f"tokenize rejected all {tally.rows_in:,} rows of {in_parquet} ({reasons}); see {rejects_path}"
        )


def tokenize_dataset(
    in_parquet: Path, out_dir: Path, tokenizer: Any, cfg: TokenizeConfig, progress: ProgressFn | None = None
) -> tuple[dict[str, Path], dict]:
    """Tokenize + mask every row of the merged parquet; writes tokenized.parquet and tokenize_rejects.jsonl."""
    start = time.perf_counter()
    out_dir = Path(out_dir)
    end_of_turn = end_of_turn_text(tokenizer)
    source = pq.ParquetFile(in_parquet)
    if source.metadata.num_rows == 0:
        raise EmptyTokenizeError(f"no rows to tokenize: {in_parquet} holds 0 rows")
    tally = _Tally()
    rejects: list[dict] = []
    out_path = out_dir / TOKENIZED_FILE
    with Progress(source.metadata.num_rows, "tokenize", progress) as bar, atomic_path(out_path) as tmp:
        with pq.ParquetWriter(tmp, TOKENIZED_SCHEMA) as writer:
            columns = ["id", "split", "messages", *[TRUNCATED_TURNS] * (TRUNCATED_TURNS in source.schema_arrow.names)]
            for batch in source.iter_batches(batch_size=CHUNK_ROWS, columns=columns):
                rows = batch.to_pylist()
                tally.rows_in += len(rows)
                writer.write_table(_chunk_table(_tokenize_chunk(rows, tokenizer, cfg, end_of_turn, rejects, tally)))
                bar.update(len(rows), tokens=tally.num_tokens, rejected=sum(tally.rejected.values()))
        rejects_path = _write_rejects(out_dir / "tokenize_rejects.jsonl", rejects)
        _check_not_empty(tally, in_parquet, rejects_path)  # before the empty table replaces tokenized.parquet
    stats = _stats(tally, time.perf_counter() - start, end_of_turn)
    return {"tokenized": out_path, "rejects": rejects_path}, stats


def read_tokenized(path: Path, columns: list[str] | None = None, split: str | None = None) -> pa.Table:
    """The tokenized table (optionally some columns, optionally one split), checked against the schema."""
    names = list(TOKENIZED_SCHEMA.names) if columns is None else list(columns)
    # The split filter needs the split column even when the caller did not ask for it.
    read = names if split is None or "split" in names else [*names, "split"]
    table = pq.read_table(path, columns=read)
    expected = pa.schema([TOKENIZED_SCHEMA.field(c) for c in read])
    if not table.schema.equals(expected, check_metadata=False):
        raise ValueError(f"{path}: unexpected schema {table.schema}, expected {expected}")
    if split is not None:
        table = table.filter(pc.equal(table["split"], split))
    return table.select(names)
