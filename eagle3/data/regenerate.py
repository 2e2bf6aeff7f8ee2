"""Re-answer every user turn of each conversation with the target model (EAGLE-3 regeneration).

The drafter learns to predict the target's own tokens, so the assistant turns of the training data
are replaced by what the target says. Answers are produced turn by turn on the *regenerated*
history, as the EAGLE-3 paper did: for [system?, u1, a1, u2, a2] we send [system?, u1] -> a1',
then [system?, u1, a1', u2] -> a2'. The original assistant turns are never sent.

Which messages become answers, and each conversation's answering: eagle3.data.regenerate_turns.

Resumability: every finished conversation (success or error) is appended to
``regenerate.journal.jsonl`` and fsynced at once. A re-run skips ids already in the journal
(``skipped_done``) unless their input row or the generation settings changed. The final
``regenerated.parquet`` and ``regenerate_errors.jsonl`` are written atomically from the journal,
in the input's row order. A failed conversation is never half-regenerated: it is absent from the
parquet and present in the errors file with its reason.
With regenerate.num_slices > 1 several hosts answer disjoint slices, each into its own
``regenerate.journal.slice-K.jsonl`` (eagle3.data.regenerate_slices); every run here first folds such slice
journals into the main one (``fold_slice_journals``), so what a stopped sliced run answered is kept.

Failures: a row error (HTTP 4xx, 5xx or timeouts after the retries, empty or malformed answers)
is journaled like a success and not retried by a re-run unless ``retry_errors=True``. An
endpoint that cannot be reached at all raises EndpointUnreachable and stops the run instead
(finished rows stay journaled), and so does any unexpected exception, which is a bug, not data.

Rows beyond ``cfg.max_conversations`` are counted as ``skipped_limit`` and copied to the output
with their ORIGINAL answers, so downstream stages still see every input row.

Rows of ``keep_sources`` are copied as they are and counted as ``skipped_source``: synthetic sources hold the
target's own answers already (eagle3.data.synthesize), and sources with ``keep_answers`` keep the dataset's
answers on purpose (text the target reads but did not write: training still takes its soft labels from the
target, so such text adds data without generation time).

Runaway loops (``regenerate.cut_loops``): a small target's greedy answers often repeat a phrase until the
token cap, and such tails can be most of the tokens (SmolLM2-135M: 87% of the answer words of 6,000
ShareGPT conversations, docs/data.md). An answer that hit the cap is cut a few repeats after its loop starts
(eagle3.data.textcheck.loop_cut; regenerate_turns.LoopCuts) and stays marked truncated; the turns after it are
dropped. The journal keeps
the whole answers, so turning the setting on or off regenerates nothing.

Invariant (asserted): success + error + skipped_done + skipped_source + skipped_limit == input rows.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3.config import RegenerateConfig
from eagle3.data.chat_backends import (  # noqa: F401 - re-exported: the backends are part of regeneration's API
    ChatBackend,
    Completion,
    CompletionError,
    EndpointUnreachable,
    HFGenerateBackend,
    Message,
    OpenAIChatBackend,
    make_backend,
    parse_chat_response,
)
from eagle3.data.regenerate_turns import LoopCuts, plan_turns, regenerate_conversation, truncated_turns
from eagle3.data.tokenize import TRUNCATED_TURNS
from eagle3.run.journal import Journal
from eagle3.run.layout import REGENERATED_FILE
from eagle3.run.progress import Progress, ProgressFn
from infra.storage import atomic_path, atomic_write_text, sha256_json

REGENERATED_NAME = REGENERATED_FILE
ERRORS_NAME = "regenerate_errors.jsonl"
JOURNAL_NAME = "regenerate.journal.jsonl"
SLICE_JOURNAL_PREFIX = "regenerate.journal.slice-"
"""Slice K of a sliced run journals into regenerate.journal.slice-K.jsonl."""


# --------------------------------------------------------------------------- journal records


def settings_key(cfg: RegenerateConfig) -> str:
    """Hash of the settings that change the answers; journal records from other settings are redone.
    loop_stop_tokens only once set, so journals written before it existed keep their key."""
    fields: tuple[str, ...] = ("backend", "model", "max_new_tokens", "temperature")
    fields += ("loop_stop_tokens",) if cfg.loop_stop_tokens else ()
    return sha256_json({k: getattr(cfg, k) for k in fields})[:16]


def is_reusable(
    record: dict[str, Any] | None, row: dict[str, Any], key: str, retry_errors: bool, max_user_turns: int | None = None
) -> bool:
    """Whether a journal record still answers ``row`` (same input, same settings), so the row is not sent again."""
    if record is None or record.get("settings") != key or record.get("content_hash") != row.get("content_hash"):
        return False
    if record.get("status") != "ok":
        return not retry_errors
    # max_user_turns is not in the settings key (old journals keep theirs): an answer is reused only if it
    # answered exactly the turns the current setting asks for.
    return len(record.get("finish_reasons") or ()) == plan_turns(row["messages"], max_user_turns).count(None)


# --------------------------------------------------------------------------- the run


@dataclass
class RunState:
    """Counters of a run (or of the slices of one), shared by the workers (one event loop, so no locks)."""

    success: int = 0
    error: int = 0
    num_turns: int = 0
    finish_reasons: Counter[str] = field(default_factory=Counter)
    max_user_turns: int | None = None
    cut_loops: bool = False

    def count(self, record: dict[str, Any]) -> None:
        """Add one finished conversation's journal record."""
        if record["status"] == "ok":
            self.success += 1
            self.num_turns += len(record["finish_reasons"])
            self.finish_reasons.update(str(r) for r in record["finish_reasons"])
        else:
            self.error += 1


async def _process_row(
    row: dict[str, Any], backend: ChatBackend, key: str, max_user_turns: int | None = None
) -> dict[str, Any]:
    """One conversation -> its journal record (ok or error)."""
    record: dict[str, Any] = {"id": row["id"], "content_hash": row.get("content_hash"), "settings": key}
    try:
        messages, reasons = await regenerate_conversation(row["messages"], backend, row["id"], max_user_turns)
    except CompletionError as exc:
        return {
            **record,
            "status": "error",
            "error_type": exc.kind,
            "message": exc.message,
            "attempts": exc.num_attempts,
        }
    return {**record, "status": "ok", "messages": messages, "finish_reasons": reasons}


async def run_rows(
    todo: list[dict[str, Any]],
    backend: ChatBackend,
    key: str,
    append: Callable[[dict[str, Any]], None],
    state: RunState,
    progress: Progress,
) -> None:
    """Keep backend.max_parallel conversations in flight; journal each one as it finishes."""
    rows = iter(todo)

    async def worker() -> None:
        # A shared iterator instead of one task per row keeps memory flat on millions of rows.
        for row in rows:
            record = await _process_row(row, backend, key, state.max_user_turns)
            append(record)
            state.count(record)
            progress.update(1, success=state.success, error=state.error)

    async with backend.session():
        tasks = [asyncio.create_task(worker()) for _ in range(max(1, min(backend.max_parallel, len(todo))))]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def read_rows(in_parquet: Path) -> tuple[list[dict[str, Any]], pa.Schema]:
    """The input's rows and schema; an error naming the file for missing columns or a duplicate id."""
    table = pq.read_table(in_parquet)
    missing = {"id", "messages"} - set(table.column_names)
    if missing:
        raise ValueError(f"{in_parquet} lacks column(s) {sorted(missing)}")
    rows = table.to_pylist()
    ids = [r["id"] for r in rows]
    if len(set(ids)) != len(ids):
        dup = next(i for i, n in Counter(ids).items() if n > 1)
        raise ValueError(f"{in_parquet} has duplicate id {dup!r}; the journal is keyed by id")
    return rows, table.schema


def _write_outputs(
    rows: list[dict[str, Any]],
    schema: pa.Schema,
    limit: int,
    journal: dict[str, dict[str, Any]],
    out_dir: Path,
    keep_sources: frozenset[str] = frozenset(),
    max_user_turns: int | None = None,
    cuts: LoopCuts | None = None,
) -> dict[str, Path]:
    """regenerated.parquet (input order, with TRUNCATED_TURNS) and the errors file, both atomic, from the journal;
    with ``cuts``, runaway loops are cut off the answers (counted there)."""
    kept: list[dict[str, Any]] = []
    errors: list[str] = []
    for i, row in enumerate(rows):
        if i >= limit or row.get("source") in keep_sources:
            kept.append({**row, TRUNCATED_TURNS: []})  # beyond max_conversations, or answered by the target already
            continue
        record = journal.get(row["id"])
        assert record is not None, f"row {row['id']!r} finished without a journal record"
        if record["status"] == "ok":
            messages, truncated = record["messages"], truncated_turns(row, record, max_user_turns)
            if cuts is not None:
                messages, truncated = cuts.cut(messages, truncated)
            kept.append({**row, "messages": messages, TRUNCATED_TURNS: truncated})
        else:
            errors.append(
                json.dumps({k: record[k] for k in ("id", "error_type", "message", "attempts")}, ensure_ascii=False)
            )
    assert len(kept) + len(errors) == len(rows), "every input row must be regenerated, kept or an error"
    paths = {"regenerated": out_dir / REGENERATED_NAME, "errors": out_dir / ERRORS_NAME}
    with atomic_path(paths["regenerated"]) as tmp:
        if TRUNCATED_TURNS not in schema.names:
            schema = schema.append(pa.field(TRUNCATED_TURNS, pa.list_(pa.int32())))
        pq.write_table(pa.Table.from_pylist(kept, schema=schema), tmp)
    atomic_write_text(paths["errors"], "".join(line + "\n" for line in errors))
    return paths


@dataclass(frozen=True)
class Work:
    """The input rows and which of them are left to regenerate (what every run, sliced or not, starts from)."""

    rows: list[dict[str, Any]]
    schema: pa.Schema
    limit: int
    """Rows past this index are kept with their original answers (max_conversations)."""
    own: int
    """Rows below the limit of keep_sources (copied as they are)."""
    todo: list[dict[str, Any]]
    """Rows to answer, shortest first (similar lengths batch together)."""


def pending_work(
    in_parquet: Path,
    out_dir: Path,
    cfg: RegenerateConfig,
    retry_errors: bool = False,
    keep_sources: frozenset[str] = frozenset(),
) -> Work:
    """Read the input and the journal (first folding in the slice journals of a sliced run that stopped): the
    rows no reusable journal record answers yet."""
    rows, schema = read_rows(Path(in_parquet))
    fold_slice_journals(Path(out_dir))
    done, key = Journal(Path(out_dir) / JOURNAL_NAME).load(), settings_key(cfg)
    limit = min(len(rows), cfg.max_conversations or len(rows))
    own = sum(r.get("source") in keep_sources for r in rows[:limit])
    todo = [
        r
        for r in rows[:limit]
        if r.get("source") not in keep_sources
        and not is_reusable(done.get(r["id"]), r, key, retry_errors, cfg.max_user_turns)
    ]
    todo.sort(key=conversation_chars)
    return Work(rows, schema, limit, own, todo)


def conversation_chars(row: dict[str, Any]) -> int:
    """Characters of a conversation's messages: the sort key of batching and the weight of a slice."""
    return sum(len(m["content"]) for m in row["messages"])


def regenerate(
    in_parquet: Path,
    out_dir: Path,
    cfg: RegenerateConfig,
    backend: ChatBackend,
    progress: ProgressFn | None = None,
    retry_errors: bool = False,
    keep_sources: frozenset[str] = frozenset(),
) -> tuple[dict[str, Path], dict]:
    """Re-answer the user turns of every row of ``in_parquet``; resumable through the journal.

    ``retry_errors=True`` sends rows that failed in an earlier run again (by default an error
    in the journal counts as done, like a success). Rows of ``keep_sources`` (synthetic sources,
    whose answers the target wrote already) are copied as they are and counted as ``skipped_source``.
    """
    start = time.monotonic()
    out_dir = Path(out_dir)
    work = pending_work(in_parquet, out_dir, cfg, retry_errors, keep_sources)
    state = RunState(max_user_turns=cfg.max_user_turns, cut_loops=cfg.cut_loops)
    with Journal(out_dir / JOURNAL_NAME).appender() as append, Progress(len(work.todo), "regenerate", progress) as bar:
        run_sync(run_rows(work.todo, backend, settings_key(cfg), append, state, bar))
    return finish(work, out_dir, state, backend, keep_sources, start)


def finish(
    work: Work, out_dir: Path, state: RunState, backend: ChatBackend | None, keep_sources: frozenset[str], start: float
) -> tuple[dict[str, Path], dict]:
    """Write the outputs from the journal and return (paths, stats) with the invariant checked."""
    rows, limit, own = work.rows, work.limit, work.own
    stats: dict[str, Any]
    stats = {
        "input": len(rows),
        "success": state.success,
        "error": state.error,
        "skipped_done": limit - own - len(work.todo),
        "skipped_source": own,
        "skipped_limit": len(rows) - limit,
        "num_turns": state.num_turns,
        "num_requests": _backend_counter(backend, "num_requests"),
        "num_retries": _backend_counter(backend, "num_retries"),
        "finish_reasons": dict(sorted(state.finish_reasons.items())),
    }
    generation = generation_stats(backend)
    if generation is not None:
        stats["generation"] = generation
    assert stats["success"] + stats["error"] + stats["skipped_done"] + own + stats["skipped_limit"] == len(rows)
    cuts = LoopCuts() if state.cut_loops else None
    paths = _write_outputs(
        rows,
        work.schema,
        limit,
        Journal(out_dir / JOURNAL_NAME).load(),
        out_dir,
        keep_sources,
        state.max_user_turns,
        cuts,
    )
    if cuts is not None:
        stats["loop_cuts"] = asdict(cuts)
    stats["elapsed_s"] = round(time.monotonic() - start, 3)
    return paths, stats


# --------------------------------------------------------------------------- slice journals


def slice_journal_path(out_dir: Path, index: int) -> Path:
    """The journal slice ``index`` of a sliced run appends to (one writer per file, also on shared storage)."""
    return Path(out_dir) / f"{SLICE_JOURNAL_PREFIX}{index}.jsonl"


def slice_journals(out_dir: Path) -> list[Path]:
    """The slice journals in ``out_dir``, by slice index."""
    found = []
    for path in Path(out_dir).glob(f"{SLICE_JOURNAL_PREFIX}*.jsonl"):
        index = path.name[len(SLICE_JOURNAL_PREFIX) : -len(".jsonl")]
        if index.isdigit():
            found.append((int(index), path))
    return [path for _, path in sorted(found)]


def fold_slice_journals(out_dir: Path) -> int:
    """Append the records of every slice journal to the main journal (slice order; per id its latest) and delete
    the slice files; the number of records moved.

    Only called while no slice runs (before planning, at finalize). A conversation is answered by one slice, so
    the order changes no answer; a fixed order keeps the main journal's bytes reproducible. Killed half-way, the
    records moved already are in both files, and the next fold appends them again: the latest record wins."""
    moved, paths = 0, slice_journals(out_dir)
    main = Journal(Path(out_dir) / JOURNAL_NAME)
    for path in paths:
        moved += main.extend(Journal(path).load().values())
    for path in paths:
        path.unlink()
    return moved


def run_sync(coro: Coroutine[Any, Any, None]) -> None:
    """asyncio.run, also from code that already runs an event loop (a notebook, an async task)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def generation_stats(backend: Any) -> dict[str, Any] | None:
    """An in-process backend's generate figures (tokens, seconds, slot use, shapes; data/generate.py), else None."""
    stats = getattr(getattr(backend, "generator", None), "stats", None)
    return stats.to_json() if stats is not None else None


def _backend_counter(backend: ChatBackend | None, name: str) -> int | None:
    """A backend's optional counter (requests, retries), None when it keeps none."""
    value = getattr(backend, name, None)
    return int(value) if isinstance(value, int) else None
