"""Writing a shard: ``ShardStream`` writes rows in place as samples arrive; ``write_shard`` writes a whole list.

The header, offsets, input_ids and loss_mask come from the request and are written first; each
sample's rows then go straight to their offset in a temp file (pwrite), the sha256 is computed in file
order on a thread of its own, and ``commit`` renames the sealed file into place before writing the
done file (last). A crash or a bad sample leaves the old state or a temp file, never a done file that
vouches for other bytes.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

import infra.storage as storage
from eagle3.features.fp8 import quantize_fp8
from eagle3.features.shards.check import (
    ShardValidationError,
    check_echo,
    check_finite,
    check_request_ids,
    check_sample,
    validate_samples,
)
from eagle3.features.shards.done import ShardDone
from eagle3.features.shards.layout import (
    done_path_for,
    encode_header,
    file_order,
    nbytes,
    shard_layout,
    shard_metadata,
    spec_hash,
    storage_dtype,
)
from eagle3.features.spec import CapturedSample, FeatureSpec, SampleTokens
from infra.storage import atomic_write_json

WRITE_CHUNK_BYTES = 64 << 20
"""Largest single pwrite call."""
WRITEBACK_BYTES = 64 << 20
"""With early writeback, the kernel is asked to start writing a shard's dirty pages every this many bytes."""
HASH_BACKLOG_BYTES = 512 << 20
"""Bytes a shard writer may hand to its hashing thread ahead of the hash (it waits beyond that)."""
SYNC_FILE_RANGE_WRITE = 2  # Linux sync_file_range flag: start writeback of dirty pages, do not wait for it


class ShardWriteError(RuntimeError):
    """Writing one shard failed: the message names the shard, the original error is the cause."""

    def __init__(self, shard: str, cause: BaseException):
        super().__init__(f"{shard}: {type(cause).__name__}: {cause}")
        self.shard = shard


def _cast_states(spec: FeatureSpec, sample: CapturedSample) -> dict[str, torch.Tensor]:
    """One sample's captured states in storage dtypes, on the CPU, contiguous (ids and mask excluded)."""
    aux = sample.aux.detach().to("cpu")
    out: dict[str, torch.Tensor] = {}
    if spec.aux_dtype == "float8_e4m3fn":
        out["aux"], out["aux_scale"] = quantize_fp8(aux)  # [T, A*H] e4m3, [T] fp32
    else:
        out["aux"] = aux.to(storage_dtype(spec.aux_dtype))
    if spec.supervision == "final_hidden":
        assert sample.final is not None  # (check_sample ran first)
        out["final"] = sample.final.detach().to("cpu", storage_dtype(spec.dtype))
    else:
        assert sample.topk_ids is not None and sample.topk_logprobs is not None  # (check_sample ran first)
        out["topk_ids"] = sample.topk_ids.detach().to("cpu", torch.int32)
        out["topk_logprobs"] = sample.topk_logprobs.detach().to("cpu", torch.float32)
    for name in ("aux", "final"):  # a cast to fp16 can overflow values that were finite in fp32
        if name in out and out[name].dtype == torch.float16:
            check_finite(sample.id, name, out[name])
    return {k: v.contiguous() for k, v in out.items()}


def _request_tensors(requested: Sequence[SampleTokens]) -> tuple[torch.Tensor, torch.Tensor]:
    """The request's input_ids [T] int32 and loss_mask [T] uint8, samples concatenated in order."""
    ids, masks = [], []
    for req in requested:
        try:
            ids.append(torch.as_tensor(req.input_ids, dtype=torch.int64).reshape(-1))
            masks.append(torch.as_tensor(req.loss_mask).reshape(-1).to(torch.uint8))
        except (TypeError, ValueError, RuntimeError, OverflowError) as err:
            raise ShardValidationError(req.id, f"requested input_ids/loss_mask are not integer lists ({err})") from err
        if ids[-1].numel() != masks[-1].numel():
            raise ShardValidationError(
                req.id, f"requested loss_mask has {masks[-1].numel()} entries for {ids[-1].numel()} tokens"
            )
    return torch.cat(ids).to(torch.int32), torch.cat(masks)


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (works for bf16 and fp8, which numpy lacks)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """os.pwrite until every byte is written, WRITE_CHUNK_BYTES at a time."""
    done = 0
    while done < view.nbytes:
        num = os.pwrite(fd, view[done : done + WRITE_CHUNK_BYTES], offset + done)
        if num <= 0:
            raise OSError(f"pwrite wrote nothing at offset {offset + done}")
        done += num


def _load_sync_file_range() -> Callable[..., int] | None:
    """libc's sync_file_range (Linux), or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()


class _OrderedHasher:
    """sha256 of a file whose pieces arrive out of order: a piece is hashed once every byte before it
    has been; until then it is held (pinned host memory is copied out so staging buffers can recycle).

    The hashing itself runs on a thread of its own (hashlib releases the GIL), so it overlaps the
    writer's validation and pwrite calls; at most HASH_BACKLOG_BYTES wait for it.
    """

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self.num_hashed = 0  # bytes handed to the hashing thread, always a prefix of the file
        self._held: dict[int, torch.Tensor | memoryview] = {}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sha256")  # one worker: updates stay in order
        self._backlog: deque[tuple[Future, int]] = deque()
        self._backlog_bytes = 0

    def add(self, offset: int, piece: torch.Tensor | memoryview) -> None:
        num_bytes = piece.nbytes
        if num_bytes == 0:
            return
        if offset < self.num_hashed or offset in self._held:
            raise AssertionError(f"bytes at offset {offset} arrived twice")
        ahead = offset != self.num_hashed
        if ahead and isinstance(piece, torch.Tensor) and torch.cuda.is_initialized() and piece.is_pinned():
            piece = piece.clone()
        self._held[offset] = piece
        while self.num_hashed in self._held:
            held = self._held.pop(self.num_hashed)
            view = _as_bytes(held) if isinstance(held, torch.Tensor) else held
            self._backlog.append((self._thread.submit(self.digest.update, view), view.nbytes))
            self._backlog_bytes += view.nbytes
            self.num_hashed += view.nbytes
            while self._backlog_bytes > HASH_BACKLOG_BYTES:
                self._wait_oldest()

    def _wait_oldest(self) -> None:
        future, num_bytes = self._backlog.popleft()
        future.result()
        self._backlog_bytes -= num_bytes

    def hexdigest(self) -> str:
        """Wait for the hashing thread, then the hex digest of everything handed to it."""
        while self._backlog:
            self._wait_oldest()
        self._thread.shutdown()
        return self.digest.hexdigest()

    def close(self) -> None:
        """Stop the hashing thread (pending updates are dropped)."""
        self._thread.shutdown(wait=True, cancel_futures=True)


class ShardStream:
    """One shard written as its samples arrive; the bytes equal those of writing all samples at once.

    The header, offsets, input_ids and loss_mask are known from the request and written first; each
    captured sample's rows go straight to their place in the temp file (pwrite). sha256 needs file
    order, so rows that arrive ahead of the hashed prefix (the ``final`` region while ``aux`` rows
    are still coming) are held until the prefix reaches them. ``early_writeback`` asks the kernel to
    start writing dirty pages every WRITEBACK_BYTES (Linux), so the fsync in ``seal`` finds little
    left. ``seal`` checks that every sample and byte arrived and fsyncs; ``commit`` renames and then
    writes the done file; ``abort`` removes the temp file. One thread drives a stream.
    """

    def __init__(self, path: Path, spec: FeatureSpec, requested: Sequence[SampleTokens], early_writeback: bool = True):
        self.path, self.spec, self.requested = Path(path), spec, list(requested)
        check_request_ids(self.requested)
        input_ids, loss_mask = _request_tensors(self.requested)  # [T] int32, [T] uint8
        lengths = [len(req.input_ids) for req in self.requested]
        self._first_row = [0, *itertools.accumulate(lengths)]  # the offsets tensor: [S + 1]
        self.num_tokens, self.num_loss_tokens = self._first_row[-1], int(loss_mask.sum())
        layout = shard_layout(spec, self.num_tokens, len(lengths))
        header = encode_header(layout, shard_metadata(spec, [req.id for req in self.requested]))
        self._start, self._row_bytes, begin = {}, {}, len(header)
        for name in file_order(layout):
            dtype, shape = layout[name]
            self._start[name], self._row_bytes[name] = begin, nbytes(dtype, shape[1:])
            begin += nbytes(dtype, shape)
        self.num_bytes, self._next, self._hasher, self._sha256 = begin, 0, _OrderedHasher(), ""
        self._writeback = _SYNC_FILE_RANGE if early_writeback else None
        self._unflushed = 0
        done_path_for(self.path).unlink(missing_ok=True)  # an old done file must never vouch for the new bytes
        self._tmp = storage.temp_path_for(self.path)
        self._fd: int | None = os.open(self._tmp, os.O_WRONLY)
        try:
            self._put(0, memoryview(header))
            offsets = torch.tensor(self._first_row, dtype=torch.int64)
            for name, tensor in (("offsets", offsets), ("input_ids", input_ids), ("loss_mask", loss_mask)):
                self._put(self._start[name], tensor)
        except BaseException:
            self.abort()
            raise

    def append(self, samples: Iterable[CapturedSample], validated: bool = False) -> None:
        """Write the next samples, in request order; each is checked against its request and the spec
        first (ShardValidationError naming it) unless the caller did so already (``validated``)."""
        for sample in samples:
            position = self._next
            if position >= len(self.requested):
                raise ShardValidationError(
                    sample.id, f"backend returned more than the {len(self.requested)} requested samples"
                )
            if not validated:
                check_echo(sample, self.requested[position], position)
                check_sample(self.spec, sample)
            num_rows = self._first_row[position + 1] - self._first_row[position]
            for name, tensor in _cast_states(self.spec, sample).items():
                if tensor.nbytes != num_rows * self._row_bytes[name]:
                    raise AssertionError(f"sample {sample.id!r}: {name} has {tensor.nbytes} bytes for {num_rows} rows")
                self._put(self._start[name] + self._first_row[position] * self._row_bytes[name], tensor)
            self._next += 1

    def _put(self, offset: int, piece: torch.Tensor | memoryview) -> None:
        view = _as_bytes(piece) if isinstance(piece, torch.Tensor) else piece
        _pwrite_all(self._open_fd(), view, offset)
        self._hasher.add(offset, piece)
        self._unflushed += view.nbytes
        if self._writeback is not None and self._unflushed >= WRITEBACK_BYTES:
            self._unflushed = 0
            if self._writeback(self._fd, 0, 0, SYNC_FILE_RANGE_WRITE) != 0:
                self._writeback = None  # unsupported here: the fsync in seal() does all the work

    def seal(self) -> None:
        """Check that every requested sample and every byte arrived, then fsync the temp file."""
        if self._next != len(self.requested):
            missing = [req.id for req in self.requested[self._next :]]
            raise ShardValidationError(
                missing[0],
                f"backend returned {self._next} of {len(self.requested)} requested samples (missing {missing[:5]})",
            )
        if self._hasher.num_hashed != self.num_bytes:
            raise AssertionError(f"{self.path.name}: {self._hasher.num_hashed} of {self.num_bytes} bytes arrived")
        fd = self._open_fd()
        os.fsync(fd)  # while the hashing thread finishes the rows that were held for file order
        self._sha256 = self._hasher.hexdigest()
        os.close(fd)
        self._fd = None

    def _open_fd(self) -> int:
        if self._fd is None:
            raise RuntimeError(f"{self.path.name}: written or sealed after seal() or abort()")
        return self._fd

    def commit(self) -> ShardDone:
        """Rename the sealed temp file into place, then write the done file (last); returns the done document."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path.name}: commit() before seal()")
        storage.commit_temp(self._tmp, self.path)
        ids = [req.id for req in self.requested]
        doc = ShardDone(
            format_version=self.spec.format_version,
            file=self.path.name,
            sample_ids=ids,
            num_samples=len(ids),
            num_tokens=self.num_tokens,
            num_loss_tokens=self.num_loss_tokens,
            num_bytes=self.num_bytes,
            sha256=self._sha256,
            spec_hash=spec_hash(self.spec),
        )
        atomic_write_json(done_path_for(self.path), doc.to_json())
        return doc

    def abort(self) -> None:
        """Close and delete the temp file: a failed or cancelled shard leaves nothing behind."""
        self._hasher.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._tmp.unlink(missing_ok=True)


def write_shard(
    path: Path, spec: FeatureSpec, samples: Sequence[CapturedSample], requested: Sequence[SampleTokens] | None = None
) -> ShardDone:
    """Validate every sample, then write ``path`` (safetensors) atomically and its done file; returns the
    done document.

    ``requested`` (the samples that were sent to the backend) adds the echo check: same ids in the
    same order and the same tokens, so states can never be filed under the wrong sample.
    """
    validate_samples(spec, samples, requested)
    if requested is None:
        requested = [SampleTokens(s.id, s.input_ids.tolist(), s.loss_mask.tolist()) for s in samples]
    stream = ShardStream(path, spec, requested)
    try:
        stream.append(samples, validated=True)
        stream.seal()
        return stream.commit()
    except BaseException:
        stream.abort()
        raise
