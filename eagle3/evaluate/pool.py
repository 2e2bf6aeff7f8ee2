"""Measuring many prompts: in this process or a pool of spawned ones, in an order that covers every dataset early,
each finished prompt journaled at once so a killed evaluation resumes with the prompts it had not finished.

A journal line is ``{"id": "<index>", "key": "<stage key>", "record": PromptRecord.to_json()}``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from eagle3.evaluate.prompts import EvalPrompt
from eagle3.evaluate.records import PromptRecord, RecordError
from eagle3.evaluate.session import EvalJob, EvalSession, evaluate_prompt, ready_session
from eagle3.run.journal import Journal
from eagle3.run.progress import Progress, ProgressFn

Item = tuple[int, EvalPrompt, list[int]]
"""(index in the planned prompt list, prompt, rendered token ids)."""

_SESSION: EvalSession | None = None  # the spawned process's session (set by _init_worker)


def _init_worker(job: EvalJob, warmup_ids: list[int]) -> None:
    global _SESSION
    import torch

    if job.num_threads:
        torch.set_num_threads(job.num_threads)
    _SESSION = ready_session(job, warmup_ids)


def _run_item(item: Item) -> PromptRecord:
    assert _SESSION is not None, "_init_worker runs first in each worker"
    return evaluate_prompt(_SESSION, *item)


def evaluate_prompts(
    job: EvalJob,
    items: Sequence[tuple[EvalPrompt, list[int]]],
    num_workers: int = 1,
    progress: ProgressFn | None = None,
    show_bar: bool | None = None,
    journal: Journal | None = None,
    key: str = "",
) -> list[PromptRecord]:
    """Per-prompt records in prompt order; num_workers > 1 spreads prompts over spawned processes.

    With a journal, every finished prompt is appended at once and prompts already journaled under the
    same key are not measured again, so a killed evaluation resumes where it stopped.
    """
    indexed = [(i, p, ids) for i, (p, ids) in enumerate(items)]
    done = journaled_records(journal, key, indexed)
    todo = interleaved([item for item in indexed if item[0] not in done])
    records = list(done.values())
    with Progress(len(indexed), "evaluate", progress, bar=show_bar) as bar, _appender(journal) as append:
        bar.update(len(done), resumed=len(done))
        for record in _measure(job, todo, indexed[0][2], num_workers):
            append({"id": str(record.index), "key": key, "record": record.to_json()})
            records.append(record)
            bar.update(1)
    return sorted(records, key=lambda r: r.index)


def interleaved(items: Sequence[Item]) -> list[Item]:
    """Measuring order: the first prompt of every dataset, then the second of each, ...; a run cut short (and
    its partial report) then covers every dataset. Records keep their index, so outputs stay in prompt order."""
    ranks: dict[str, int] = {}
    keyed = []
    for item in items:
        rank = ranks.get(item[1].dataset, 0)
        ranks[item[1].dataset] = rank + 1
        keyed.append((rank, item[0], item))
    return [item for _, _, item in sorted(keyed, key=lambda k: k[:2])]


def journaled_records(journal: Journal | None, key: str, indexed: Sequence[Item]) -> dict[int, PromptRecord]:
    """Records journaled under this key for these very prompts (same index, dataset, id and length)."""
    if journal is None:
        return {}
    entries = journal.load()
    done = {}
    for index, prompt, ids in indexed:
        entry = entries.get(str(index))
        if not entry or entry.get("key") != key or not entry.get("record"):
            continue
        try:
            record = PromptRecord.from_json(entry["record"])
        except RecordError as exc:
            raise RecordError(f"{journal.path}, entry {index}: {exc}") from None
        if (record.dataset, record.id, record.prompt_tokens) == (prompt.dataset, prompt.id, len(ids)):
            done[index] = record
    return done


@contextlib.contextmanager
def _appender(journal: Journal | None) -> Iterator[Callable[[dict[str, Any]], None]]:
    if journal is None:
        yield lambda entry: None
        return
    with journal.appender() as append:
        yield append


def _measure(job: EvalJob, todo: list[Item], warmup_ids: list[int], num_workers: int) -> Iterator[PromptRecord]:
    """Records of the prompts in ``todo`` as they finish (in this process, or a pool of spawned ones)."""
    if not todo:
        return
    if num_workers <= 1:
        session = ready_session(job, warmup_ids)
        for item in todo:
            yield evaluate_prompt(session, *item)
        return
    import multiprocessing

    pool = multiprocessing.get_context("spawn").Pool(min(num_workers, len(todo)), _init_worker, (job, warmup_ids))
    with pool:
        yield from pool.imap_unordered(_run_item, todo)
