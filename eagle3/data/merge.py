"""The merge stage: several chat sources -> one deduplicated, shuffled, split table of conversations.

Outputs under ``out_dir`` (each written atomically):

- ``merged.parquet``: one row per kept conversation (schema ``MERGED_SCHEMA``);
- ``rejects.jsonl``: one line per record that did not become a row, with reason and the whole record (a record
  longer than 16 KiB: an excerpt, its sha256 and size, eagle3.data.rejects.RECORD_CAP_CHARS);
- ``stats.json``: per source and in total: read, kept, rejected (by reason), train/val, turns, chars.

For every source and in total ``kept + rejected == read``; the stage checks it before writing stats.
A synthetic source is read from the file the synthesize stage wrote (eagle3.data.synthetic). With
``data.eval_overlap`` every record of every source is checked against the evaluation prompts
(eagle3.data.textcheck.EvalOverlap) and rejected as ``eval_overlap`` when it holds one or a near-copy.

The stage step (key, manifest, skip) is eagle3.run.stages.run_merge, which calls ``merge_sources``:

    python -m eagle3.run.stages merge --preset tiny --set data.val_fraction=0.1
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3.config import DataConfig, SourceConfig
from eagle3.data.rejects import reject_line
from eagle3.data.sources import (
    REJECT_REASONS,
    Conversation,
    Reject,
    SourceError,
    SourceStream,
    content_hash,
    read_source,
)
from eagle3.data.synthetic import read_synthetic
from eagle3.data.textcheck import EVAL_NGRAM, EvalOverlap
from eagle3.run.layout import MERGE_STATS_FILE, MERGED_FILE
from eagle3.run.progress import Progress, ProgressFn
from infra.storage import atomic_open, atomic_path, atomic_write_json

__all__ = ["MERGED_SCHEMA", "MergeError", "content_hash", "merge_sources", "read_merged", "split_for"]

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
MERGED_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("split", pa.string()),
        ("messages", pa.list_(MESSAGE_TYPE)),
        ("content_hash", pa.string()),
    ]
)
PROGRESS_EVERY = 500
"""Records between progress updates (a per-record callback would slow reading and flood listeners)."""


class MergeError(ValueError):
    """The merge kept fewer rows than data.min_rows: an empty (or nearly empty) dataset is an error, not a result."""


def split_for(row_id: str, seed: int, val_fraction: float) -> str:
    """'train' or 'val' from a seeded hash of the id: stable across runs, machines and input order."""
    digest = hashlib.sha256(f"{seed}\0{row_id}".encode()).digest()
    unit = int.from_bytes(digest[:8], "big") / 2**64
    return "val" if unit < val_fraction else "train"


@dataclass
class _Tally:
    """Counts for one source (or the total)."""

    read: int = 0
    kept: int = 0
    rejected: int = 0
    rejected_by_reason: Counter = field(default_factory=Counter)
    train: int = 0
    val: int = 0
    num_turns: int = 0
    num_chars: int = 0
    num_dropped_turns: int = 0

    def add(self, other: _Tally) -> None:
        """Add another tally's counts into this one."""
        for name in ("read", "kept", "rejected", "train", "val", "num_turns", "num_chars", "num_dropped_turns"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.rejected_by_reason.update(other.rejected_by_reason)

    def count_reject(self, reason: str) -> None:
        """One more record rejected for ``reason``."""
        self.rejected += 1
        self.rejected_by_reason[reason] += 1

    def count_row(self, conv: Conversation) -> None:
        """One more record kept as a row."""
        self.kept += 1
        self.num_turns += len(conv.messages)
        self.num_chars += conv.num_chars
        self.num_dropped_turns += conv.num_dropped_turns

    def to_json(self) -> dict[str, Any]:
        """JSON-able counts; every reason is listed, zeros included, so tables line up across runs."""
        doc = {
            name: getattr(self, name)
            for name in ("read", "kept", "rejected", "train", "val", "num_turns", "num_chars", "num_dropped_turns")
        }
        doc["rejected_by_reason"] = {r: self.rejected_by_reason.get(r, 0) for r in REJECT_REASONS}
        return doc


class _RejectWriter:
    """Appends Reject lines to rejects.jsonl (an atomic temp file until the merge succeeds)."""

    def __init__(self, fh: IO[bytes]):
        self.fh = fh

    def write(self, reject: Reject) -> None:
        """One JSON line (eagle3.data.rejects.reject_line: always valid JSON)."""
        self.fh.write(reject_line(reject))


def _open(src: SourceConfig, cfg: DataConfig, data_dir: Path) -> SourceStream:
    """The source's records: its file, or for a synthetic source what the synthesize stage wrote."""
    if src.format == "synthetic":
        return read_synthetic(src, data_dir, cfg.max_chars, cfg.max_chars_of)
    return read_source(src, cfg.max_chars, cfg.max_chars_of)


@dataclass
class _EvalCheck:
    """The evaluation-prompt index and what it rejected, by dataset."""

    index: EvalOverlap
    num_prompts: dict[str, int]
    rejected: Counter = field(default_factory=Counter)

    def reject(self, conv: Conversation) -> Reject | None:
        """An eval_overlap Reject for a record that holds an evaluation prompt or a near-copy, else None."""
        hit = self.index.check(m["content"] for m in conv.messages)
        if hit is None:
            return None
        self.rejected[hit.prompt_id.split(":")[0]] += 1
        return Reject(
            conv.source,
            conv.location,
            "eval_overlap",
            hit.describe(),
            {"id": conv.id, "messages": conv.messages},
            conv.id,
        )

    def to_json(self, min_shared: int) -> dict[str, Any]:
        """What stats.json says about the check."""
        return {
            "enabled": True,
            "ngram": EVAL_NGRAM,
            "min_shared_ngrams": min_shared,
            "eval_prompts": self.num_prompts,
            "rejected": sum(self.rejected.values()),
            "rejected_by_dataset": {name: self.rejected.get(name, 0) for name in self.num_prompts},
        }


def _eval_check(cfg: DataConfig) -> _EvalCheck | None:
    """The index of every prompt of every evaluation dataset (eagle3.evaluate.prompts), built once; None when off."""
    if not cfg.eval_overlap:
        return None
    from eagle3.evaluate.prompts import DATASET_FILES, read_prompts

    prompts = {name: read_prompts(name) for name in DATASET_FILES}
    index = EvalOverlap(((p.id, p.text) for ps in prompts.values() for p in ps), cfg.eval_overlap_min_ngrams)
    return _EvalCheck(index, {name: len(ps) for name, ps in prompts.items()})


def _check_sources(sources: list[SourceConfig], cfg: DataConfig, data_dir: Path) -> None:
    if not sources:
        raise SourceError("no data sources configured: nothing to merge")
    counts = Counter(src.name for src in sources)
    repeated = sorted(name for name, num in counts.items() if num > 1)
    if repeated:
        # Ids are '<source>:<id>', so two sources with one name could silently share ids.
        raise SourceError(f"source names must be unique; repeated: {repeated}")
    for src in sources:
        # Open (and sniff) each source now, so a bad last source fails before minutes spent on the first.
        _open(src, cfg, data_dir).close()


def _dedupe(
    conv: Conversation, seen_hashes: dict[str, str], scope: dict[str, str], dedupe: bool
) -> dict[str, Any] | Reject:
    """The row for a conversation, or a duplicate_content Reject naming the row that came first.

    ``scope`` is what the conversation must not repeat: ``seen_hashes`` (every source's rows), or, for a source
    with ``dedupe_scope: source``, its own rows only, so a file's own answers can sit beside the same file
    re-answered by another source. ``seen_hashes`` always records the first row of each content (its split)."""
    digest = content_hash(conv.messages)
    if dedupe and digest in scope:
        record = {"id": conv.id, "messages": conv.messages}
        return Reject(
            conv.source, conv.location, "duplicate_content", f"same content as {scope[digest]}", record, conv.id
        )
    seen_hashes.setdefault(digest, conv.id)
    scope.setdefault(digest, conv.id)
    return {"id": conv.id, "source": conv.source, "split": "", "messages": conv.messages, "content_hash": digest}


def _take_source(
    src: SourceConfig,
    cfg: DataConfig,
    seen_hashes: dict[str, str],
    rows: list[dict[str, Any]],
    rejects: _RejectWriter,
    prog: Progress,
    data_dir: Path,
    evals: _EvalCheck | None,
) -> tuple[_Tally, dict[str, Any]]:
    """Read one source until it ends or reaches its cap; returns its tally and facts for stats.json."""
    tally = _Tally()
    scope: dict[str, str] = {} if src.dedupe_scope == "source" else seen_hashes
    stream = _open(src, cfg, data_dir)
    stopped_at_cap = False
    with contextlib.closing(stream):
        for item in stream:
            tally.read += 1
            if tally.read % PROGRESS_EVERY == 0:
                prog.update(PROGRESS_EVERY, source=src.name, kept=len(rows))
            row: dict[str, Any] | Reject = (
                item
                if isinstance(item, Reject)
                else ((evals and evals.reject(item)) or _dedupe(item, seen_hashes, scope, cfg.dedupe))
            )
            if isinstance(row, Reject):
                rejects.write(row)
                tally.count_reject(row.reason)
                continue
            rows.append(row)
            assert isinstance(item, Conversation)  # (a Reject item is its own row, written above)
            tally.count_row(item)
            if src.max_records is not None and tally.kept >= src.max_records:
                stopped_at_cap = True
                break  # the rest of the source is never read: a cap of 2k on a 100k file costs 2k records
    prog.update(tally.read % PROGRESS_EVERY, source=src.name, kept=len(rows))
    facts = {
        "path": str(stream.path),
        "format": stream.format,
        "max_records": src.max_records,
        "stopped_at_cap": stopped_at_cap,
    }
    return tally, facts


def _assign_splits(
    rows: list[dict[str, Any]], seed: int, val_fraction: float, tallies: dict[str, _Tally], first_ids: dict[str, str]
) -> None:
    """Each row's split by its id, or by the id of the first row with its content (``first_ids``: content hash ->
    id), so the same conversation kept by two sources is never in both splits."""
    for row in rows:
        row["split"] = split_for(first_ids[row["content_hash"]], seed, val_fraction)
        tally = tallies[row["source"]]
        tally.train += row["split"] == "train"
        tally.val += row["split"] == "val"


def _check_invariants(tallies: dict[str, _Tally], total: _Tally, num_rows: int) -> None:
    """Every record read is either a row or a reject, and every row has exactly one split."""
    for name, tally in [*tallies.items(), ("total", total)]:
        if tally.kept + tally.rejected != tally.read or tally.train + tally.val != tally.kept:
            raise AssertionError(f"merge counts do not add up for {name}: {tally.to_json()}")
        if sum(tally.rejected_by_reason.values()) != tally.rejected:
            raise AssertionError(f"rejects by reason do not add up for {name}: {tally.to_json()}")
    if total.kept != num_rows:
        raise AssertionError(f"{num_rows} rows collected but {total.kept} counted as kept")


def _write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    table = pa.Table.from_pylist(rows, schema=MERGED_SCHEMA)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def _stats_doc(
    tallies: dict[str, _Tally], facts: dict[str, dict], cfg: DataConfig, seed: int, evals: _EvalCheck | None
) -> tuple[dict[str, Any], _Tally]:
    total = _Tally()
    for tally in tallies.values():
        total.add(tally)
    return {
        "sources": {name: {**facts[name], **tally.to_json()} for name, tally in tallies.items()},
        "total": total.to_json(),
        "seed": seed,
        "val_fraction": cfg.val_fraction,
        "dedupe": cfg.dedupe,
        "shuffle": cfg.shuffle,
        "max_chars": cfg.max_chars,
        "max_chars_of": cfg.max_chars_of,
        "eval_overlap": evals.to_json(cfg.eval_overlap_min_ngrams) if evals else {"enabled": False},
    }, total


def merge_sources(
    sources: list[SourceConfig], cfg: DataConfig, seed: int, out_dir: Path, progress: ProgressFn | None = None
) -> tuple[dict[str, Path], dict[str, Any]]:
    """Read, validate, dedupe, cap, shuffle and split the sources; write merged/rejects/stats.

    Returns ({"merged": path, "rejects": path, "stats": path}, stats). Progress counts records read;
    its total is the sum of the caps when every source has one, else 0 (unknown).
    """
    out_dir = Path(out_dir)
    _check_sources(sources, cfg, out_dir)
    evals = _eval_check(cfg)
    paths = {"merged": out_dir / MERGED_FILE, "rejects": out_dir / "rejects.jsonl", "stats": out_dir / MERGE_STATS_FILE}
    caps = [s.max_records for s in sources if s.max_records is not None]
    num_expected = sum(caps) if len(caps) == len(sources) else 0
    rows: list[dict[str, Any]] = []
    seen_hashes: dict[str, str] = {}  # content hash -> id of the first row with it (dedupe spans sources)
    tallies: dict[str, _Tally] = {}
    facts: dict[str, dict] = {}
    with Progress(num_expected, "merge", progress) as prog, atomic_open(paths["rejects"]) as fh:
        for src in sources:
            tallies[src.name], facts[src.name] = _take_source(
                src, cfg, seen_hashes, rows, _RejectWriter(fh), prog, out_dir, evals
            )
    if cfg.shuffle:
        random.Random(seed).shuffle(rows)
    _assign_splits(rows, seed, cfg.val_fraction, tallies, seen_hashes)
    stats, total = _stats_doc(tallies, facts, cfg, seed, evals)
    _check_invariants(tallies, total, len(rows))
    atomic_write_json(paths["stats"], stats)  # written even when too few rows were kept: it says why
    _check_min_rows(total, cfg.min_rows, paths)
    _write_parquet(rows, paths["merged"])
    return paths, stats


def _check_min_rows(total: _Tally, min_rows: int, paths: dict[str, Path]) -> None:
    """MergeError naming the counts, the main reject reasons and the files to read when too few rows were kept."""
    if total.kept >= min_rows:
        return
    reasons = ", ".join(f"{reason} {num:,}" for reason, num in total.rejected_by_reason.most_common(4))
    raise MergeError(
        f"merge kept {total.kept:,} of {total.read:,} records read, fewer than data.min_rows="
        f"{min_rows:,} (rejected: {reasons or 'none'}); see {paths['rejects']} and {paths['stats']}"
    )


def read_merged(path: Path | str) -> list[dict[str, Any]]:
    """Rows of merged.parquet as dicts (messages as a list of {'role', 'content'} dicts), in file order."""
    return pq.read_table(path).to_pylist()
