"""Shard files: one safetensors file of concatenated samples plus a ``.done.json`` written last.

A shard exists for readers only when its ``shard-NNNNN.done.json`` is present, names the current
spec hash and records the safetensors file's exact size. ``ShardStream`` writes a shard into a temp
file as its samples arrive, checking each sample (request echo, shapes, finiteness, ids) before its
rows are written and hashing the bytes in file order (no second pass over a multi-GB file); once
every sample is in it fsyncs, renames into place, then writes the done file. ``write_shard``
validates a whole list, then streams it. A crash or a bad sample leaves the old state or a temp file.

The safetensors file is serialized here rather than by ``safetensors.torch.save_file`` so that
(a) per-sample tensors are written straight from their buffers without first concatenating them
(which would double peak memory), (b) the sha256 is computed on the bytes as they are written,
and (c) the exact file size and every tensor's offset are known from the spec and the request
alone, which makes the disk preflight exact (``shard_file_bytes``) and lets rows be written as
soon as they exist. The files are standard safetensors; any reader loads them.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import json
import os
import re
import struct
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import infra.storage as storage
from eagle3.features.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8
from eagle3.features.spec import CapturedSample, FeatureSpec, SampleTokens
from infra.storage import atomic_write_json, sha256_file_cached, sha256_json

SHARD_RE = re.compile(r"^shard-(\d{5,})\.done\.json$")
DONE_SUFFIX = ".done.json"
ST_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", FP8_DTYPE: "F8_E4M3",
                  torch.int32: "I32", torch.uint8: "U8", torch.int64: "I64"}
HEADER_ALIGN = 8
"""Payload starts on an 8-byte boundary; tensors are ordered by element size so each stays aligned."""
WRITE_CHUNK_BYTES = 64 << 20
"""Largest single pwrite call."""
WRITEBACK_BYTES = 64 << 20
"""With early writeback, the kernel is asked to start writing a shard's dirty pages every this many bytes."""
HASH_BACKLOG_BYTES = 512 << 20
"""Bytes a shard writer may hand to its hashing thread ahead of the hash (it waits beyond that)."""
SYNC_FILE_RANGE_WRITE = 2  # Linux sync_file_range flag: start writeback of dirty pages, do not wait for it

Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]


class ShardValidationError(ValueError):
    """A captured sample does not match its request or the spec; nothing was written."""

    def __init__(self, sample_id: str | None, problem: str):
        where = f"sample {sample_id!r}: " if sample_id is not None else ""
        super().__init__(where + problem)
        self.sample_id, self.problem = sample_id, problem


def spec_hash(spec: FeatureSpec) -> str:
    """Content hash of a spec (shards record it; a reader ignores shards of another spec)."""
    return sha256_json(spec.model_dump(mode="json"))


def shard_stem(index: int) -> str:
    """'shard-00007'."""
    return f"shard-{index:05d}"


def shard_path(features_dir: Path, index: int) -> Path:
    """<features>/shard-NNNNN.safetensors."""
    return Path(features_dir) / f"{shard_stem(index)}.safetensors"


def done_path_for(st_path: Path) -> Path:
    """shard-NNNNN.safetensors -> shard-NNNNN.done.json."""
    st_path = Path(st_path)
    return st_path.with_name(st_path.name.removesuffix(".safetensors") + DONE_SUFFIX)


def _storage_dtype(name: str) -> torch.dtype:
    return FP8_DTYPE if name == "float8_e4m3fn" else getattr(torch, name)


def shard_layout(spec: FeatureSpec, num_tokens: int, num_samples: int) -> Layout:
    """Name -> (dtype, shape) of every tensor a shard of this spec holds (see spec.py's module doc)."""
    t, h = num_tokens, spec.hidden_size
    layout: Layout = {"aux": (_storage_dtype(spec.aux_dtype), (t, spec.num_aux * h))}
    if spec.aux_dtype == "float8_e4m3fn":
        layout["aux_scale"] = (torch.float32, (t,))
    if spec.supervision == "final_hidden":
        layout["final"] = (_storage_dtype(spec.dtype), (t, h))
    else:
        layout["topk_ids"] = (torch.int32, (t, spec.topk or 0))
        layout["topk_logprobs"] = (torch.float32, (t, spec.topk or 0))
    layout["input_ids"] = (torch.int32, (t,))
    layout["loss_mask"] = (torch.uint8, (t,))
    layout["offsets"] = (torch.int64, (num_samples + 1,))
    return layout


def _ordered(layout: Layout) -> list[str]:
    """Largest element size first (then by name) keeps every tensor aligned to its element size."""
    return sorted(layout, key=lambda n: (-layout[n][0].itemsize, n))


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    num = 1
    for dim in shape:
        num *= dim
    return num * dtype.itemsize


def shard_metadata(spec: FeatureSpec, sample_ids: Sequence[str]) -> dict[str, str]:
    """The safetensors __metadata__ (strings only): enough to identify the shard without its done file."""
    return {"format_version": str(spec.format_version), "spec_hash": spec_hash(spec),
            "sample_ids": json.dumps(list(sample_ids), ensure_ascii=False),
            "aux_layer_ids": json.dumps(spec.aux_layer_ids), "aux_convention": spec.aux_convention}


def encode_header(layout: Layout, metadata: dict[str, str]) -> bytes:
    """8-byte little-endian length + JSON header padded with spaces to HEADER_ALIGN."""
    header: dict[str, Any] = {"__metadata__": metadata}
    begin = 0
    for name in _ordered(layout):
        dtype, shape = layout[name]
        end = begin + _nbytes(dtype, shape)
        header[name] = {"dtype": ST_DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [begin, end]}
        begin = end
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-(8 + len(text)) % HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text


def shard_file_bytes(spec: FeatureSpec, sample_ids: Sequence[str], num_tokens: int) -> int:
    """Exact size of the safetensors file for these samples (header included)."""
    layout = shard_layout(spec, num_tokens, len(sample_ids))
    payload = sum(_nbytes(dtype, shape) for dtype, shape in layout.values())
    return len(encode_header(layout, shard_metadata(spec, sample_ids))) + payload


# ---- validation -------------------------------------------------------------------------------


def _check_shape(sample_id: str, name: str, tensor: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    if tensor is None:
        raise ShardValidationError(sample_id, f"{name} is missing")
    if tuple(tensor.shape) != shape:
        raise ShardValidationError(sample_id, f"{name} has shape {list(tensor.shape)}, expected {list(shape)}")


def _check_finite(sample_id: str, name: str, tensor: torch.Tensor) -> None:
    values = tensor.float() if tensor.dtype == FP8_DTYPE else tensor
    # A sum is NaN/inf whenever any element is, and is ~300x faster than isfinite on CPUs without AVX2;
    # only a non-finite sum (which may also be an overflow of finite values) pays for the exact check.
    if bool(torch.isfinite(values.sum())):
        return
    bad = ~torch.isfinite(values)
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        raise ShardValidationError(sample_id, f"{name} has {int(bad.sum())} non-finite values (first at token {row})")


def _check_ids(sample_id: str, name: str, ids: torch.Tensor, vocab_size: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ShardValidationError(sample_id, f"{name} outside [0, {vocab_size})")


def check_sample(spec: FeatureSpec, sample: CapturedSample) -> None:
    """Shapes, id ranges and finiteness of one sample against the spec (ShardValidationError naming it)."""
    sid, ids = sample.id, sample.input_ids
    if ids.dim() != 1 or ids.shape[0] == 0:
        raise ShardValidationError(sid, f"input_ids must be a non-empty 1-D tensor, got shape {list(ids.shape)}")
    t = ids.shape[0]
    if t > spec.max_len:
        raise ShardValidationError(sid, f"{t} tokens exceed spec.max_len {spec.max_len}")
    _check_ids(sid, "input_ids", ids, spec.vocab_size)
    _check_shape(sid, "loss_mask", sample.loss_mask, (t,))
    _check_shape(sid, "aux", sample.aux, (t, spec.num_aux * spec.hidden_size))
    _check_finite(sid, "aux", sample.aux)
    if spec.supervision == "final_hidden":
        _check_shape(sid, "final", sample.final, (t, spec.hidden_size))
        _check_finite(sid, "final", sample.final)
    else:
        _check_shape(sid, "topk_ids", sample.topk_ids, (t, spec.topk or 0))
        _check_shape(sid, "topk_logprobs", sample.topk_logprobs, (t, spec.topk or 0))
        _check_ids(sid, "topk_ids", sample.topk_ids, spec.vocab_size)
        _check_finite(sid, "topk_logprobs", sample.topk_logprobs)


def _check_tokens(sample: CapturedSample, req: SampleTokens) -> None:
    if sample.input_ids.tolist() != list(req.input_ids):
        raise ShardValidationError(sample.id, "input_ids differ from the requested tokens")
    if sample.loss_mask.tolist() != list(req.loss_mask):
        raise ShardValidationError(sample.id, "loss_mask differs from the requested mask")


def _check_echo(sample: CapturedSample, req: SampleTokens, position: int) -> None:
    """One streamed sample is the request at its position, with the requested tokens and mask."""
    if sample.id != req.id:
        raise ShardValidationError(sample.id, f"backend returned ids out of order or wrong ({sample.id!r} at "
                                              f"position {position}, where {req.id!r} was requested)")
    _check_tokens(sample, req)


def check_against_request(samples: Sequence[CapturedSample], requested: Sequence[SampleTokens]) -> None:
    """The backend echoed exactly the requested ids, in order, with the requested tokens."""
    got, want = [s.id for s in samples], [r.id for r in requested]
    if got != want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        first = next((g for g, w in zip(got, want) if g != w), None)
        raise ShardValidationError(first, f"backend returned ids out of order or wrong (missing {missing[:5]}, "
                                          f"unexpected {extra[:5]}, {len(got)} returned for {len(want)} requested)")
    for sample, req in zip(samples, requested):
        _check_tokens(sample, req)


def _check_request_ids(items: Sequence[CapturedSample] | Sequence[SampleTokens]) -> None:
    """At least one sample, and no id twice."""
    if not items:
        raise ShardValidationError(None, "a shard needs at least one sample")
    seen: set[str] = set()
    for item in items:
        if item.id in seen:
            raise ShardValidationError(item.id, "duplicate sample id in one shard")
        seen.add(item.id)


def validate_samples(spec: FeatureSpec, samples: Sequence[CapturedSample],
                     requested: Sequence[SampleTokens] | None = None) -> None:
    """Everything write_shard checks before writing a byte (ids unique, request echoed, each sample sound)."""
    _check_request_ids(samples)
    if requested is not None:
        check_against_request(samples, requested)
    for sample in samples:
        check_sample(spec, sample)


# ---- writing ----------------------------------------------------------------------------------


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
        out["aux"] = aux.to(_storage_dtype(spec.aux_dtype))
    if spec.supervision == "final_hidden":
        out["final"] = sample.final.detach().to("cpu", _storage_dtype(spec.dtype))
    else:
        out["topk_ids"] = sample.topk_ids.detach().to("cpu", torch.int32)
        out["topk_logprobs"] = sample.topk_logprobs.detach().to("cpu", torch.float32)
    for name in ("aux", "final"):  # a cast to fp16 can overflow values that were finite in fp32
        if name in out and out[name].dtype == torch.float16:
            _check_finite(sample.id, name, out[name])
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
            raise ShardValidationError(req.id, f"requested loss_mask has {masks[-1].numel()} entries for "
                                               f"{ids[-1].numel()} tokens")
    return torch.cat(ids).to(torch.int32), torch.cat(masks)


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (works for bf16 and fp8, which numpy lacks)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """os.pwrite until every byte is written, WRITE_CHUNK_BYTES at a time."""
    done = 0
    while done < view.nbytes:
        num = os.pwrite(fd, view[done:done + WRITE_CHUNK_BYTES], offset + done)
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

    def __init__(self, path: Path, spec: FeatureSpec, requested: Sequence[SampleTokens],
                 early_writeback: bool = True):
        self.path, self.spec, self.requested = Path(path), spec, list(requested)
        _check_request_ids(self.requested)
        input_ids, loss_mask = _request_tensors(self.requested)  # [T] int32, [T] uint8
        lengths = [len(req.input_ids) for req in self.requested]
        self._first_row = [0, *itertools.accumulate(lengths)]  # the offsets tensor: [S + 1]
        self.num_tokens, self.num_loss_tokens = self._first_row[-1], int(loss_mask.sum())
        layout = shard_layout(spec, self.num_tokens, len(lengths))
        header = encode_header(layout, shard_metadata(spec, [req.id for req in self.requested]))
        self._start, self._row_bytes, begin = {}, {}, len(header)
        for name in _ordered(layout):
            dtype, shape = layout[name]
            self._start[name], self._row_bytes[name] = begin, _nbytes(dtype, shape[1:])
            begin += _nbytes(dtype, shape)
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
                raise ShardValidationError(sample.id, f"backend returned more than the {len(self.requested)} "
                                                      f"requested samples")
            if not validated:
                _check_echo(sample, self.requested[position], position)
                check_sample(self.spec, sample)
            num_rows = self._first_row[position + 1] - self._first_row[position]
            for name, tensor in _cast_states(self.spec, sample).items():
                if tensor.nbytes != num_rows * self._row_bytes[name]:
                    raise AssertionError(f"sample {sample.id!r}: {name} has {tensor.nbytes} bytes for {num_rows} rows")
                self._put(self._start[name] + self._first_row[position] * self._row_bytes[name], tensor)
            self._next += 1

    def _put(self, offset: int, piece: torch.Tensor | memoryview) -> None:
        view = _as_bytes(piece) if isinstance(piece, torch.Tensor) else piece
        _pwrite_all(self._fd, view, offset)
        self._hasher.add(offset, piece)
        self._unflushed += view.nbytes
        if self._writeback is not None and self._unflushed >= WRITEBACK_BYTES:
            self._unflushed = 0
            if self._writeback(self._fd, 0, 0, SYNC_FILE_RANGE_WRITE) != 0:
                self._writeback = None  # unsupported here: the fsync in seal() does all the work

    def seal(self) -> None:
        """Check that every requested sample and every byte arrived, then fsync the temp file."""
        if self._next != len(self.requested):
            missing = [req.id for req in self.requested[self._next:]]
            raise ShardValidationError(missing[0], f"backend returned {self._next} of {len(self.requested)} "
                                                   f"requested samples (missing {missing[:5]})")
        if self._hasher.num_hashed != self.num_bytes:
            raise AssertionError(f"{self.path.name}: {self._hasher.num_hashed} of {self.num_bytes} bytes arrived")
        os.fsync(self._fd)  # while the hashing thread finishes the rows that were held for file order
        self._sha256 = self._hasher.hexdigest()
        os.close(self._fd)
        self._fd = None

    def commit(self) -> dict[str, Any]:
        """Rename the sealed temp file into place, then write the done file (last); returns the done document."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path.name}: commit() before seal()")
        storage.commit_temp(self._tmp, self.path)
        ids = [req.id for req in self.requested]
        doc = {"format_version": self.spec.format_version, "file": self.path.name, "sample_ids": ids,
               "num_samples": len(ids), "num_tokens": self.num_tokens, "num_loss_tokens": self.num_loss_tokens,
               "num_bytes": self.num_bytes, "sha256": self._sha256,
               "spec_hash": spec_hash(self.spec)}
        atomic_write_json(done_path_for(self.path), doc)
        return doc

    def abort(self) -> None:
        """Close and delete the temp file: a failed or cancelled shard leaves nothing behind."""
        self._hasher.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._tmp.unlink(missing_ok=True)


def write_shard(path: Path, spec: FeatureSpec, samples: Sequence[CapturedSample],
                requested: Sequence[SampleTokens] | None = None) -> dict[str, Any]:
    """Validate every sample, then write ``path`` (safetensors) atomically and its done file; returns the
    done document.

    ``requested`` (the samples that were sent to the backend) adds the echo check: same ids in the
    same order and the same tokens, so states can never be filed under the wrong sample.
    """
    validate_samples(spec, samples, requested)
    if requested is None:
        requested = [SampleTokens(s.id, s.input_ids, s.loss_mask) for s in samples]
    stream = ShardStream(path, spec, requested)
    try:
        stream.append(samples, validated=True)
        stream.seal()
        return stream.commit()
    except BaseException:
        stream.abort()
        raise


# ---- reading ----------------------------------------------------------------------------------


def read_done(done_path: Path) -> dict[str, Any] | None:
    """A done document, or None when absent or unreadable."""
    try:
        return json.loads(Path(done_path).read_text())
    except (OSError, ValueError):
        return None


def shard_is_complete(st_path: Path, doc: dict[str, Any] | None, expected_spec_hash: str) -> bool:
    """Done file present for this spec and the safetensors file has exactly the recorded size."""
    if not doc or doc.get("spec_hash") != expected_spec_hash:
        return False
    st_path = Path(st_path)
    return st_path.is_file() and st_path.stat().st_size == doc.get("num_bytes")


def complete_shards(features_dir: Path, expected_spec_hash: str) -> dict[int, dict[str, Any]]:
    """Index -> done document of every complete shard in the directory (temp files never match)."""
    found: dict[int, dict[str, Any]] = {}
    for done in sorted(Path(features_dir).glob(f"shard-*{DONE_SUFFIX}")):
        match = SHARD_RE.match(done.name)
        if not match:
            continue
        doc = read_done(done)
        index = int(match.group(1))
        if shard_is_complete(shard_path(features_dir, index), doc, expected_spec_hash):
            found[index] = doc
    return found


class CorruptShardError(ValueError):
    """A complete shard's bytes no longer have the sha256 its done file records."""


class ShardReader:
    """Random access to the samples of the complete shards of a features directory, memory-mapped.

    Tensors are read with ``safetensors.safe_open`` slices, so ``get`` touches only that sample's
    rows; nothing is loaded up front except the done documents and offsets. A shard is verified
    against its done file's sha256 when first opened (once per process and file version), so a
    corrupted shard stops its consumer with the file named instead of feeding it wrong states.
    """

    def __init__(self, features_dir: Path):
        self.features_dir = Path(features_dir)
        self.spec = FeatureSpec.load(self.features_dir / "spec.json")
        self.spec_hash = spec_hash(self.spec)
        self.shards = complete_shards(self.features_dir, self.spec_hash)
        self._where: dict[str, tuple[int, int]] = {}
        for index, doc in self.shards.items():
            for position, sample_id in enumerate(doc["sample_ids"]):
                if sample_id in self._where:
                    other = self._where[sample_id][0]
                    raise ValueError(f"sample {sample_id!r} is in both {shard_stem(other)} and {shard_stem(index)}")
                self._where[sample_id] = (index, position)
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._where

    def ids(self) -> list[str]:
        """Sample ids in shard order, then in-shard order."""
        return list(self._where)

    @property
    def num_tokens(self) -> int:
        """Tokens over all complete shards."""
        return sum(doc["num_tokens"] for doc in self.shards.values())

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            from safetensors import safe_open

            if not self.verify(index):
                path, done = shard_path(self.features_dir, index), done_path_for(shard_path(self.features_dir, index))
                raise CorruptShardError(f"{path} does not match the sha256 in {done.name} (corrupted on disk); "
                                        f"delete {done} and run the capture again, which recaptures that shard")
            handle = safe_open(str(shard_path(self.features_dir, index)), framework="pt")
            self._handles[index] = handle
            self._offsets[index] = handle.get_tensor("offsets").tolist()
        return self._handles[index]

    def get(self, sample_id: str) -> dict[str, torch.Tensor]:
        """One sample's tensors; fp8 aux comes back dequantized to bf16."""
        if sample_id not in self._where:
            raise KeyError(f"sample {sample_id!r} is in no complete shard of {self.features_dir}")
        index, position = self._where[sample_id]
        handle = self._handle(index)
        begin, end = self._offsets[index][position], self._offsets[index][position + 1]
        names = [name for name in handle.keys() if name not in ("offsets", "aux_scale")]
        out = {name: handle.get_slice(name)[begin:end] for name in names}
        if "aux_scale" in handle.keys():
            out["aux"] = dequantize_fp8(out["aux"], handle.get_slice("aux_scale")[begin:end], torch.bfloat16)
        return out

    def verify(self, shard_index: int) -> bool:
        """The shard file's sha256 (hashed once per process and file version) equals its done document's."""
        return sha256_file_cached(shard_path(self.features_dir, shard_index)) == self.shards[shard_index]["sha256"]

    def close(self) -> None:
        """Drop the open file handles (and their mappings)."""
        self._handles.clear()
