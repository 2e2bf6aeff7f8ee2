"""The capture loop: forwards feed a pool of shard writers, so writing overlaps the forwards.

    capture_and_write   every job's samples -> its shard (the loop ``run_capture`` and the benchmark run)
    ShardWriters        the pool: one lane (queue + ShardStream) per shard, up to ``num_writers`` at once
    WriteOptions        the write knobs of CaptureConfig (stream_writes, num_writers, write_queue_bytes, ...)

With ``stream_writes`` a captured sample is queued for its shard's lane as soon as the backend hands
it out, and the lane writes its rows into the shard file right away; the only work left when the
last forward ends is the last rows, the hash of rows held for file order, and the fsync. Without
it, the previous scheme runs: a shard is captured whole, then written while the next is captured.
The bytes of a shard are the same either way, and the same for any number of writers.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from queue import SimpleQueue
from typing import Any

from eagle3.config import CaptureConfig
from eagle3.features.shards.done import ShardDone
from eagle3.features.shards.writer import ShardStream, ShardWriteError, write_shard
from eagle3.features.spec import CaptureBackend, CapturedSample, FeatureSpec, SampleTokens


@dataclass(frozen=True)
class WriteOptions:
    """How captured shards reach the disk (the write knobs of CaptureConfig)."""

    stream: bool = True
    num_writers: int = 2
    queue_bytes: int = 4 << 30
    early_writeback: bool = True

    @classmethod
    def from_config(cls, cap: CaptureConfig) -> WriteOptions:
        """The write knobs of a capture config section."""
        return cls(cap.stream_writes, cap.num_writers, cap.write_queue_bytes, cap.early_writeback)


@dataclass
class WriteStats:
    """What the writers cost the capture loop: time it waited for queue room, and the peak bytes queued."""

    wait_s: float = 0.0
    num_waits: int = 0
    peak_queued_bytes: int = 0


class _WritersFailed(Exception):
    """Internal: a writer failed, so the capture loop stops feeding them."""


class _Cancelled(Exception):
    """Internal: a shard is not committed because the capture stopped or an earlier shard failed."""


class _ByteBudget:
    """Bytes captured but not yet written; ``take`` blocks while the bound would be exceeded."""

    def __init__(self, limit: int, stats: WriteStats):
        self.limit, self.stats, self.used, self.failed = limit, stats, 0, False
        self._cond = threading.Condition()

    def _full(self, num_bytes: int) -> bool:
        # An item larger than the whole bound is let through alone rather than never.
        return self.used > 0 and self.used + num_bytes > self.limit and not self.failed

    def take(self, num_bytes: int) -> bool:
        """Wait for room for ``num_bytes``, then count them; False (at once) after ``fail``."""
        with self._cond:
            if self._full(num_bytes):
                start, self.stats.num_waits = time.perf_counter(), self.stats.num_waits + 1
                self._cond.wait_for(lambda: not self._full(num_bytes))
                self.stats.wait_s += time.perf_counter() - start
            if self.failed:
                return False
            self.used += num_bytes
            self.stats.peak_queued_bytes = max(self.stats.peak_queued_bytes, self.used)
            return True

    def give(self, num_bytes: int) -> None:
        """Those bytes are written."""
        with self._cond:
            self.used -= num_bytes
            self._cond.notify_all()

    def fail(self) -> None:
        """Wake and refuse every taker from now on."""
        with self._cond:
            self.failed = True
            self._cond.notify_all()


_END, _ABORT = object(), object()


@dataclass
class _Lane:
    """One shard in the writer pool: its request, its queue of samples, and whether it was committed."""

    path: Path
    requested: list[SampleTokens]
    """Until the lane's ShardStream holds it."""
    previous: _Lane | None
    queue: SimpleQueue = field(default_factory=SimpleQueue)
    settled: threading.Event = field(default_factory=threading.Event)
    doc: ShardDone | None = None
    """The done document, once committed."""
    future: Future | None = None


def _sample_bytes(sample: CapturedSample) -> int:
    tensors = (sample.aux, sample.final, sample.topk_ids, sample.topk_logprobs)
    return sum(t.nbytes for t in tensors if t is not None)


class ShardWriters:
    """Shards written on a pool of threads while the capture loop keeps running forwards.

    Each shard is a lane: its samples queue up and one pool thread streams them into the shard file
    in order (a ShardStream; sha256 needs file order). Lanes of consecutive shards run side by side,
    up to ``num_writers``, so one shard's tail (last rows, hash of held rows, fsync) overlaps the next
    shard's rows. Lanes commit (rename, done file) in job order and a failed lane cancels the lanes
    after it, so the complete shards on disk are always a prefix of the jobs. Bytes queued and not yet
    written stay under ``queue_bytes``: ``put`` blocks beyond it, which pauses the forwards.
    """

    def __init__(
        self,
        spec: FeatureSpec,
        options: WriteOptions,
        stats: WriteStats | None = None,
        on_written: Callable[[ShardDone], None] | None = None,
    ):
        self.spec, self.options, self.stats, self._on_written = spec, options, stats or WriteStats(), on_written
        self._budget = _ByteBudget(options.queue_bytes, self.stats)
        self._pool = ThreadPoolExecutor(options.num_writers, thread_name_prefix="shard-writer")
        self._num_reported = 0
        self.lanes: list[_Lane] = []

    def open(self, path: Path, requested: Sequence[SampleTokens]) -> _Lane:
        """Start the lane of the next shard (job order)."""
        lane = _Lane(Path(path), list(requested), self.lanes[-1] if self.lanes else None)
        self.lanes.append(lane)
        lane.future = self._pool.submit(self._drain, lane)
        return lane

    def put(self, lane: _Lane, sample: CapturedSample) -> None:
        """Queue one captured sample, waiting for room; raises _WritersFailed once any writer failed."""
        size = _sample_bytes(sample)
        if not self._budget.take(size):
            raise _WritersFailed
        lane.queue.put((sample, size))
        self.report()

    def close(self, lane: _Lane) -> None:
        """Every sample of this lane is queued."""
        lane.queue.put(_END)

    def abort(self) -> None:
        """Cancel every lane whose samples are not all queued, wait for all threads (temp files removed)."""
        self._budget.fail()
        for lane in self.lanes:
            lane.queue.put(_ABORT)  # a lane already past its _END never reads it
        self._pool.shutdown(wait=True)

    def finish(self) -> list[ShardDone]:
        """Wait for every lane: the done documents in job order, or the first failure (ShardWriteError)."""
        self._pool.shutdown(wait=True)
        failure = self.first_error()
        if failure is not None:
            raise failure
        self.report()
        docs = [lane.doc for lane in self.lanes if lane.doc is not None]
        assert len(docs) == len(self.lanes)  # (a lane without a done document failed, raised above)
        return docs

    def report(self) -> None:
        """Hand the done documents of newly committed lanes to ``on_written``, in job order (never blocks)."""
        while self._num_reported < len(self.lanes):
            doc = self.lanes[self._num_reported].doc
            if doc is None:
                break
            self._num_reported += 1
            if self._on_written is not None:
                self._on_written(doc)

    def first_error(self) -> BaseException | None:
        """The earliest lane's failure once the pool is shut down (cancelled lanes are not failures)."""
        for lane in self.lanes:
            assert lane.future is not None  # (set by open)
            error = lane.future.exception()
            if error is not None:
                return error
        return None

    def _drain(self, lane: _Lane) -> ShardDone | None:
        stream = None
        try:
            stream = ShardStream(lane.path, self.spec, lane.requested, self.options.early_writeback)
            lane.requested = []  # the stream holds it; finished lanes keep only their done document
            self._write_queued(lane, stream)
            stream.seal()  # fsync before waiting for the previous lane: only the rename is serialized
            if lane.previous is not None:
                lane.previous.settled.wait()
                if lane.previous.doc is None:
                    raise _Cancelled
            lane.doc = stream.commit()
            return lane.doc
        except _Cancelled:
            assert stream is not None  # (raised only once the stream is open)
            stream.abort()
            return None
        except BaseException as err:
            if stream is not None:
                stream.abort()
            self._budget.fail()
            raise ShardWriteError(lane.path.name.removesuffix(".safetensors"), err) from err
        finally:
            lane.settled.set()

    def _write_queued(self, lane: _Lane, stream: ShardStream) -> None:
        while True:
            item = lane.queue.get()
            if item is _END:
                return
            if item is _ABORT:
                raise _Cancelled
            sample, size = item
            try:
                stream.append([sample])
            finally:
                self._budget.give(size)


def _tagged_samples(backend: CaptureBackend, groups: Iterable[list[SampleTokens]]) -> Iterator[tuple[int, Any]]:
    """(job index, captured sample): one pipeline through all jobs when the backend has one."""
    if hasattr(backend, "capture_many"):
        yield from backend.capture_many(groups)
        return
    for index, samples in enumerate(groups):
        for sample in backend.capture(samples):
            yield index, sample


def _stream_jobs(
    backend: CaptureBackend, jobs: Iterable[tuple[Path, list[SampleTokens]]], writers: ShardWriters
) -> None:
    """Feed every captured sample to the lane of its job; lanes open in job order as samples arrive."""
    unopened: dict[int, tuple[Path, list[SampleTokens]]] = {}  # jobs the backend has read, lane not open yet

    def groups() -> Iterator[list[SampleTokens]]:
        for index, (path, samples) in enumerate(jobs):
            unopened[index] = (Path(path), list(samples))
            yield unopened[index][1]

    def advance_to(index: int) -> None:
        while len(writers.lanes) <= index:  # a job that yielded nothing still gets a lane (and fails)
            if writers.lanes:
                writers.close(writers.lanes[-1])
            writers.open(*unopened.pop(len(writers.lanes)))

    for index, sample in _tagged_samples(backend, groups()):
        advance_to(index)
        writers.put(writers.lanes[index], sample)
    advance_to(len(writers.lanes) + len(unopened) - 1)
    if writers.lanes:
        writers.close(writers.lanes[-1])


def _write_whole_shards(
    backend: CaptureBackend,
    spec: FeatureSpec,
    jobs: Iterable[tuple[Path, list[SampleTokens]]],
    options: WriteOptions,
    on_written: Callable[[ShardDone], None] | None,
) -> list[ShardDone]:
    """Capture a whole shard, then write it on one of ``num_writers`` threads while the next is captured."""
    docs: list[ShardDone] = []
    in_flight: deque[tuple[Path, Future]] = deque()

    def collect() -> None:
        path, future = in_flight.popleft()
        try:
            docs.append(future.result())
        except Exception as err:
            raise ShardWriteError(path.name.removesuffix(".safetensors"), err) from err
        if on_written is not None:
            on_written(docs[-1])

    with ThreadPoolExecutor(options.num_writers, thread_name_prefix="shard-writer") as writer:
        for path, samples in jobs:
            captured = list(backend.capture(samples))
            while len(in_flight) >= options.num_writers:
                collect()
            in_flight.append((Path(path), writer.submit(write_shard, path, spec, captured, samples)))
        while in_flight:
            collect()
    return docs


def capture_and_write(
    backend: CaptureBackend,
    spec: FeatureSpec,
    jobs: Iterable[tuple[Path, list[SampleTokens]]],
    on_written: Callable[[ShardDone], None] | None = None,
    options: WriteOptions | None = None,
    stats: WriteStats | None = None,
) -> list[ShardDone]:
    """Capture each job's samples into its shard; writes overlap the forwards. Returns done documents in job order.

    With ``options.stream`` (default) samples go to the writer pool as they are captured (see
    ShardWriters); else each shard is captured whole and then written while the next is captured
    (at most ``num_writers`` + 1 shards in host memory). A failed write raises ShardWriteError naming
    the shard; no done file is ever written for an incomplete shard. ``on_written`` gets each done
    document on the calling thread, in job order.
    """
    options = options or WriteOptions()
    if not options.stream:
        return _write_whole_shards(backend, spec, jobs, options, on_written)
    writers = ShardWriters(spec, options, stats, on_written)
    failed = False
    try:
        _stream_jobs(backend, jobs, writers)
    except _WritersFailed:
        failed = True  # raised below, outside this handler, so the writer's error keeps its own cause
    except BaseException:
        writers.abort()
        raise
    if failed:
        writers.abort()
        raise writers.first_error() or RuntimeError("a shard writer stopped without an error")
    return writers.finish()
