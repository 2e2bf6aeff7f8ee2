"""The packing loader: captured samples packed into fixed-length rows, planned per epoch, split over ranks.

Plan of one epoch (identical on every rank, computed from ids and lengths alone, no communication):
  1. the split's (id, num_tokens) in tokenized.parquet order;
  2. a permutation seeded by (seed, epoch) for train, the file order for val;
  3. first-fit packing into rows of ``max_tokens`` tokens among the OPEN_ROWS most recently opened rows
     (bounded, so planning a million samples stays linear); a sample longer than a row is cut to it
     and counted in ``PackStats``;
  4. the rows padded by repeating the epoch's first rows until their number is a multiple of
     ``world_size * grad_accum_steps``: every rank then runs the same number of micro-batches (no rank
     waits at a collective for another that ran out of data) and every optimizer step has exactly
     ``grad_accum_steps`` micro-batches per rank. Repeats are marked ``counted=False``: train steps use
     them (at most world*accum - 1 per epoch), validation excludes them from its sums.
Rank r takes rows r, r + W, r + 2W, ... of the padded list, so optimizer step s reads the rows
[s*W*A, (s+1)*W*A) of the plan on any (W, A) with the same product: 1 process x 2 accumulation steps
and 2 processes x 1 see the same global batches. The sampler position is (epoch, index into the rank's
list), saved in checkpoints. Each row keeps its place in the padded plan (``PackedRow.index``), which seeds its
aux noise and DFlash anchors: a row draws the same numbers whichever rank reads it.

A row holds its documents back to back, then padding that forms a document of its own (loss_mask 0):
document_ids count 0, 1, ... per row and positions restart at 0 in each document, so no attention,
shift or loss crosses a document end (eagle3.drafter.masks).

Shape letters: T tokens per row (max_tokens), A*Ht aux width, Ht target hidden, K top-K.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import torch
from torch import Tensor

from eagle3.drafter.alignment import PAD_TOKEN
from eagle3.drafter.ttt import TTTBatch
from eagle3.features.shards.reader import ShardReader

OPEN_ROWS = 16
"""Rows kept open for first-fit packing; older rows are closed (bounded work per sample)."""
TOPK_PAD_LOGPROB = -1e9
"""Log-prob written into padding slots of top-K supervision (exp() is 0, and it stays finite)."""

NoiseKind = Literal["none", "uniform", "gaussian"]


@dataclass(frozen=True)
class SampleRef:
    """One sample as planned: its id and how many of its tokens the row takes (after truncation)."""

    sample_id: str
    num_tokens: int


@dataclass(frozen=True)
class PackedRow:
    """One micro-batch: samples packed into one row; ``counted=False`` marks a repeat that pads the epoch."""

    samples: tuple[SampleRef, ...]
    counted: bool = True
    index: int = 0  # place in its epoch's padded plan: seeds the row's noise (noise_seed), on any rank

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens in the row."""
        return sum(s.num_tokens for s in self.samples)


@dataclass
class PackStats:
    """What packing did to one epoch's samples."""

    num_samples: int = 0
    num_rows: int = 0
    num_tokens: int = 0
    num_truncated: int = 0
    num_truncated_tokens: int = 0
    num_repeated_rows: int = 0

    def fill(self, max_tokens: int) -> float:
        """Share of row slots holding real tokens (1.0 = no padding)."""
        return self.num_tokens / max(self.num_rows * max_tokens, 1)


@dataclass(frozen=True)
class EpochPlan:
    """The padded rows of one epoch; ``rows_for(rank, world)`` is what one rank iterates."""

    epoch: int
    rows: tuple[PackedRow, ...]
    stats: PackStats = field(compare=False, default_factory=PackStats)

    def rows_for(self, rank: int, world_size: int) -> list[PackedRow]:
        """Rows rank, rank + W, ... (equal counts on every rank: the plan is padded to a multiple of W)."""
        return list(self.rows[rank::world_size])


@dataclass
class PackedBatch:
    """A collated row: the TTT batch plus the counts the trainer logs."""

    batch: TTTBatch
    num_tokens: int  # real tokens (padding excluded)
    num_loss_tokens: int
    counted: bool
    noise_seed: int  # seeds this row's aux noise (same row -> same noise, on resume too)
    lengths: tuple[int, ...] = ()  # tokens of each real document, in row order (online features need them)
    ids: tuple[str, ...] = ()  # each real document's sample id, in row order (the online feature cache's keys)


# ------------------------------------------------------------------------------------------------ planning


def read_split(tokenized_parquet: Path, split: str) -> list[tuple[str, int]]:
    """(id, num_tokens) of the rows of one split, in file order."""
    import pyarrow.parquet as pq

    table = pq.read_table(tokenized_parquet, columns=["id", "split", "num_tokens"])
    ids, splits, lengths = (table[c].to_pylist() for c in ("id", "split", "num_tokens"))
    return [(i, int(n)) for i, s, n in zip(ids, splits, lengths) if s == split]


def check_captured(samples: Sequence[tuple[str, int]], reader: ShardReader, split: str) -> None:
    """Every planned sample must have features: a silent skip would train on a different dataset."""
    missing = [sid for sid, _ in samples if sid not in reader]
    if missing:
        raise ValueError(
            f"{len(missing)} {split} samples of tokenized.parquet have no captured features in "
            f"{reader.features_dir} (first: {missing[:3]}); run the capture stage to completion"
        )


def shuffled(samples: Sequence[tuple[str, int]], seed: int, epoch: int) -> list[tuple[str, int]]:
    """A permutation seeded by (seed, epoch): a different order every epoch, the same on every rank and rerun."""
    order = np.random.default_rng([seed, epoch]).permutation(len(samples))
    return [samples[i] for i in order]


def pack(samples: Sequence[tuple[str, int]], max_tokens: int) -> tuple[list[PackedRow], PackStats]:
    """First-fit packing into rows of ``max_tokens`` among the OPEN_ROWS newest rows; over-long samples cut."""
    rows: list[list[SampleRef]] = []
    free: list[int] = []  # free slots of rows[first_open:], aligned with them
    first_open = 0
    stats = PackStats(num_samples=len(samples))
    for sample_id, length in samples:
        used = min(length, max_tokens)
        if used < length:
            stats.num_truncated += 1
            stats.num_truncated_tokens += length - used
        slot = next((j for j, room in enumerate(free) if room >= used), None)
        if slot is None:
            rows.append([])
            free.append(max_tokens)
            slot = len(free) - 1
        rows[first_open + slot].append(SampleRef(sample_id, used))
        free[slot] -= used
        stats.num_tokens += used
        if len(free) > OPEN_ROWS:
            free.pop(0)
            first_open += 1
    stats.num_rows = len(rows)
    return [PackedRow(tuple(r)) for r in rows], stats


def pad_rows(rows: list[PackedRow], multiple: int) -> list[PackedRow]:
    """Repeat the first rows (``counted=False``) until len(rows) is a multiple of ``multiple``."""
    if not rows:
        return rows
    missing = -len(rows) % multiple
    repeats = [PackedRow(rows[i % len(rows)].samples, counted=False) for i in range(missing)]
    return rows + repeats


def plan_epoch(
    samples: Sequence[tuple[str, int]], max_tokens: int, epoch: int, seed: int, multiple: int, shuffle: bool
) -> EpochPlan:
    """The padded, packed rows of one epoch (module docstring)."""
    order = shuffled(samples, seed, epoch) if shuffle else list(samples)
    rows, stats = pack(order, max_tokens)
    padded = pad_rows(rows, multiple)
    stats.num_repeated_rows = len(padded) - len(rows)
    return EpochPlan(epoch, tuple(replace(row, index=i) for i, row in enumerate(padded)), stats)


# ----------------------------------------------------------------------------------------------- collation


def _pad_to(x: Tensor, length: int, value: float) -> Tensor:
    """x [n, ...] -> [length, ...], filled with ``value`` after row n."""
    out = x.new_full((length, *x.shape[1:]), value)
    out[: x.shape[0]] = x
    return out


class SampleSource(Protocol):
    """Where collate_row reads a sample's tensors: a ShardReader, or online training's token reader."""

    def get(self, sample_id: str) -> dict[str, Tensor]: ...


def collate_row(reader: SampleSource, row: PackedRow, max_tokens: int, float_dtype: torch.dtype) -> TTTBatch:
    """One packed row as a TTTBatch with B = 1 (module docstring: document ids, positions, padding)."""
    parts: dict[str, list[Tensor]] = {}
    docs, positions = [], []
    for doc, ref in enumerate(row.samples):
        for name, tensor in reader.get(ref.sample_id).items():
            parts.setdefault(name, []).append(tensor[: ref.num_tokens])
        docs.append(torch.full((ref.num_tokens,), doc, dtype=torch.long))
        positions.append(torch.arange(ref.num_tokens))
    num_pad = max_tokens - row.num_tokens
    docs.append(torch.full((num_pad,), len(row.samples), dtype=torch.long))  # padding: a document of its own
    positions.append(torch.arange(num_pad))
    cat = {name: torch.cat(pieces) for name, pieces in parts.items()}  # [n, ...] each, n real tokens
    pad_fill = {"input_ids": PAD_TOKEN, "loss_mask": 0, "topk_ids": 0, "topk_logprobs": TOPK_PAD_LOGPROB}
    full = {name: _pad_to(t, max_tokens, pad_fill.get(name, 0.0))[None] for name, t in cat.items()}  # [1, T, ...]
    return TTTBatch(
        aux=full["aux"].to(float_dtype) if "aux" in full else None,  # None: online, filled on the device
        input_ids=full["input_ids"].long(),
        loss_mask=full["loss_mask"],
        document_ids=torch.cat(docs)[None],
        position_ids=torch.cat(positions)[None],
        final_hidden=full["final"].to(float_dtype) if "final" in full else None,
        topk_ids=full["topk_ids"].long() if "topk_ids" in full else None,
        topk_logprobs=full.get("topk_logprobs"),
    )


def noise_seed(seed: int, epoch: int, index: int) -> int:
    """A per-row seed: the same row of the same epoch always gets the same noise, wherever it runs."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1, dtype=np.uint64)[0] >> 1)


def add_aux_noise(aux: Tensor, kind: NoiseKind, scale: float, seed: int) -> Tensor:
    """aux + noise drawn on aux's device: U(-scale, scale) or N(0, scale^2); 'none' returns aux unchanged.

    Noise on the input features makes the drafter robust to its own imperfect features at inference
    (EAGLE-1's uniform noise; speculators' +/-0.05). It is drawn from a generator seeded per row.
    """
    if kind == "none" or scale == 0.0:
        return aux
    gen = torch.Generator(device=aux.device).manual_seed(seed)
    if kind == "uniform":
        noise = torch.rand(aux.shape, generator=gen, device=aux.device, dtype=torch.float32) * (2 * scale) - scale
    else:
        noise = torch.randn(aux.shape, generator=gen, device=aux.device, dtype=torch.float32) * scale
    return (aux.float() + noise).to(aux.dtype)


def map_tensors(batch: TTTBatch, fn: Callable[[Tensor], Tensor]) -> TTTBatch:
    """A TTTBatch with ``fn`` applied to each of its tensors (None fields stay None)."""
    return TTTBatch(**{k: fn(v) if isinstance(v, Tensor) else v for k, v in vars(batch).items()})


def batch_to(batch: TTTBatch, device: torch.device) -> TTTBatch:
    """Every tensor of the batch on ``device`` (asynchronous when the loader pinned it)."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


# ------------------------------------------------------------------------------------------------- loading


class RowLoader:
    """Iterates collated rows of one rank's list from ``start``, prefetching ``depth`` rows on a thread.

    Reading, concatenating and (for CUDA) pinning a row of a large target (100 MB of aux for 4096 tokens of
    Llama-8B) then overlaps with the GPU step. Each loader owns its ShardReader: safetensors handles are not shared
    between threads.
    """

    def __init__(
        self,
        features_dir: Path,
        rows: list[PackedRow],
        max_tokens: int,
        float_dtype: torch.dtype,
        start: int = 0,
        depth: int = 2,
        epoch: int = 0,
        seed: int = 0,
        pin_memory: bool = False,
        reader: SampleSource | None = None,
    ) -> None:
        # ``reader``: a shared read-only source of the samples' tensors instead of the shards (online training)
        self.reader: SampleSource = reader if reader is not None else ShardReader(features_dir)
        self.rows, self.max_tokens, self.float_dtype = rows, max_tokens, float_dtype
        self.start, self.depth, self.epoch, self.seed = start, depth, epoch, seed
        self.pin_memory = pin_memory
        self._stop = threading.Event()

    def _item(self, index: int) -> PackedBatch:
        row = self.rows[index]
        batch = collate_row(self.reader, row, self.max_tokens, self.float_dtype)
        if self.pin_memory:  # here, on the loader thread: pinning 100 MB rows costs the training thread nothing
            batch = map_tensors(batch, Tensor.pin_memory)
        return PackedBatch(
            batch,
            row.num_tokens,
            int(batch.loss_mask.sum()),
            row.counted,
            noise_seed(self.seed, self.epoch, row.index),
            tuple(s.num_tokens for s in row.samples),
            tuple(s.sample_id for s in row.samples),
        )

    def _put(self, out: queue.Queue, item: object) -> bool:
        """Put unless the consumer has gone away (then the thread must end instead of blocking forever)."""
        while not self._stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, out: queue.Queue) -> None:
        try:
            for index in range(self.start, len(self.rows)):
                if not self._put(out, self._item(index)):
                    return
            self._put(out, None)
        except BaseException as exc:  # re-raised in the consuming thread, with its traceback
            self._put(out, exc)

    def __iter__(self) -> Generator[PackedBatch, None, None]:
        if self.depth <= 0:
            yield from (self._item(i) for i in range(self.start, len(self.rows)))
            return
        out: queue.Queue = queue.Queue(maxsize=self.depth)
        thread = threading.Thread(target=self._produce, args=(out,), daemon=True, name="row-loader")
        thread.start()
        try:
            while (item := out.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._stop.set()
            thread.join(timeout=5.0)
