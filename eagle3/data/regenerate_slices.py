"""Regeneration split across hosts (regenerate.num_slices > 1): plan slices, answer one slice, merge the journals.

The parent reads what is left to regenerate (``pending_work``: rows without a reusable record in the journal,
after folding in the slice journals of any sliced run that stopped), splits those conversations into N disjoint
slices of about equal characters (eagle3.run.slices.split_balanced) and writes them to ``regenerate.slices.json``.
Each slice run (``regenerate_slice``, on its own host, with its own backend) answers the conversations of its
slice into its own journal, ``regenerate.journal.slice-K.jsonl``: one writer per file, so concurrent hosts on a
shared filesystem never append to the same file. A slice run started again skips what its journal already has.
Once every slice run has ended, ``finish_slices`` folds the slice journals into the main journal (slice order),
checks that every planned conversation has a record (answer or error) and writes ``regenerated.parquet`` and the
errors file from the main journal exactly as a one-process run does: the same answers give the same bytes.

How the slices are run (flow runs of a deployment, threads, one after another) is the caller's: it passes a
``SliceRunner``. The parent's progress counts conversations answered over all slice journals
(``AnsweredCounter``, which reads only the bytes appended since its last look).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3.config import RegenerateConfig
from eagle3.data.regenerate import (
    JOURNAL_NAME,
    ChatBackend,
    RunState,
    Work,
    conversation_chars,
    finish,
    fold_slice_journals,
    generation_stats,
    is_reusable,
    pending_work,
    read_rows,
    run_rows,
    run_sync,
    settings_key,
    slice_journal_path,
    slice_journals,
)
from eagle3.run.journal import Journal
from eagle3.run.progress import Progress, ProgressFn
from eagle3.run.slices import split_balanced
from infra.storage import atomic_write_json

SLICES_NAME = "regenerate.slices.json"
"""The slice plan of the latest sliced run: {"slices": [[conversation id, ...], ...]}."""

SliceRunner = Callable[[int, Callable[[], None]], None]
"""run(num_slices, poll): run slices 0..num_slices-1 (each with ``regenerate_slice``) and return once every one has
ended, calling ``poll()`` now and then meanwhile (it refreshes the progress); raise if any did not complete."""


def plan_slices(work: Work, num_slices: int) -> list[list[str]]:
    """The ids of ``work.todo`` in at most ``num_slices`` disjoint lists of about equal characters."""
    return split_balanced({row["id"]: conversation_chars(row) for row in work.todo}, num_slices)


def write_slice_plan(out_dir: Path, slices: list[list[str]]) -> Path:
    """Write the slice plan (atomically) where the slice runs read it."""
    return atomic_write_json(Path(out_dir) / SLICES_NAME, {"slices": slices})


def read_slice(out_dir: Path, index: int) -> list[str]:
    """The conversation ids of slice ``index`` of the plan in ``out_dir``."""
    path = Path(out_dir) / SLICES_NAME
    try:
        slices = json.loads(path.read_text())["slices"]
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(
            f"{path}: no readable slice plan ({exc}); the parent writes it before starting slices"
        ) from exc
    if not 0 <= index < len(slices):
        raise ValueError(f"{path} plans {len(slices)} slices; there is no slice {index}")
    return slices[index]


@dataclass(frozen=True)
class SliceStats:
    """What one slice call did: its conversations, those its journal held already, and this call's answers."""

    slice: int
    conversations: int
    skipped_done: int
    success: int
    error: int
    num_turns: int
    elapsed_s: float
    generation: dict[str, Any] | None = None  # an in-process backend's generate figures (data/generate.py)

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (the field names as keys)."""
        return asdict(self)


def regenerate_slice(
    in_parquet: Path,
    out_dir: Path,
    cfg: RegenerateConfig,
    backend: ChatBackend,
    index: int,
    progress: ProgressFn | None = None,
) -> SliceStats:
    """Answer the conversations of slice ``index`` into its own journal (those it holds already are skipped)."""
    start = time.monotonic()
    ids = read_slice(out_dir, index)
    by_id = {row["id"]: row for row in read_rows(Path(in_parquet))[0]}
    unknown = [i for i in ids if i not in by_id]
    if unknown:
        raise ValueError(
            f"slice {index} of {Path(out_dir) / SLICES_NAME} names {len(unknown)} ids that are not in "
            f"{in_parquet}, e.g. {unknown[:3]}; the input changed after planning: run the stage again"
        )
    journal, key = Journal(slice_journal_path(out_dir, index)), settings_key(cfg)
    done = journal.load()
    todo = sorted(
        (by_id[i] for i in ids if not is_reusable(done.get(i), by_id[i], key, False, cfg.max_user_turns)),
        key=conversation_chars,
    )
    state = RunState(max_user_turns=cfg.max_user_turns, cut_loops=cfg.cut_loops)
    with journal.appender() as append, Progress(len(todo), f"regenerate slice {index}", progress) as bar:
        run_sync(run_rows(todo, backend, key, append, state, bar))
    return SliceStats(
        index,
        len(ids),
        len(ids) - len(todo),
        state.success,
        state.error,
        state.num_turns,
        round(time.monotonic() - start, 3),
        generation_stats(backend),
    )


class AnsweredCounter:
    """How many of ``ids`` the slice journals of ``out_dir`` hold; each look reads only the bytes appended since the
    last one (a line still being written is left for the next look; a torn one is skipped)."""

    def __init__(self, out_dir: Path, ids: Iterable[str]):
        self.out_dir, self.wanted = Path(out_dir), set(ids)
        self.answered: set[str] = set()
        self.offsets: dict[Path, int] = {}

    def __call__(self) -> int:
        for path in slice_journals(self.out_dir):
            offset = self.offsets.get(path, 0)
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read()
            end = data.rfind(b"\n") + 1
            self.offsets[path] = offset + end
            for line in data[:end].split(b"\n"):
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict) and record.get("id") in self.wanted:
                        self.answered.add(record["id"])
        return len(self.answered)


def regenerate_sliced(
    in_parquet: Path,
    out_dir: Path,
    cfg: RegenerateConfig,
    run: SliceRunner,
    progress: ProgressFn | None = None,
    keep_sources: frozenset[str] = frozenset(),
) -> tuple[dict[str, Path], dict]:
    """Plan slices of what is left, have ``run`` answer them, then merge the journals and write the outputs.

    ``progress`` gets (answered, to answer, info) over all slice journals when ``run`` polls (at most once a second).
    """
    start = time.monotonic()
    out_dir = Path(out_dir)
    work = pending_work(in_parquet, out_dir, cfg, keep_sources=keep_sources)
    slices = plan_slices(work, cfg.num_slices)
    if slices:
        write_slice_plan(out_dir, slices)
        counter = AnsweredCounter(out_dir, (row["id"] for row in work.todo))
        with Progress(len(work.todo), "regenerate", progress, bar=False) as bar:
            run(len(slices), lambda: bar.update(counter() - bar.done))
    return finish_slices(work, out_dir, cfg, keep_sources, start)


def finish_slices(
    work: Work, out_dir: Path, cfg: RegenerateConfig, keep_sources: frozenset[str], start: float
) -> tuple[dict[str, Path], dict]:
    """Fold the slice journals into the main one, check every conversation of ``work.todo`` has a record (answer or
    error), and write the outputs as a one-process run does (stats: the slices' answers; request counts unknown)."""
    fold_slice_journals(out_dir)
    records, key = Journal(out_dir / JOURNAL_NAME).load(), settings_key(cfg)
    missing = [
        row["id"] for row in work.todo if not is_reusable(records.get(row["id"]), row, key, False, cfg.max_user_turns)
    ]
    if missing:
        raise RuntimeError(
            f"{len(missing)} of {len(work.todo)} conversations planned for slices have no answer or "
            f"error in the journals of {out_dir}, e.g. {missing[:3]}; run the stage again to redo them"
        )
    state = RunState(max_user_turns=cfg.max_user_turns, cut_loops=cfg.cut_loops)
    for row in work.todo:
        state.count(records[row["id"]])
    return finish(work, out_dir, state, None, keep_sources, start)
