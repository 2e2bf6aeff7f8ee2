"""Shard files: one safetensors file of concatenated samples plus a ``.done.json`` written last.

A shard exists for readers only when its ``shard-NNNNN.done.json`` is present, names the current
spec hash and records the safetensors file's exact size. The writer validates every sample
(shapes, finiteness, ids) before anything is written, streams the tensors into a temp file while
hashing them (no second pass over a multi-GB file), renames it into place, and only then writes
the done file. A crash at any point leaves either the old state or an ignored temp file.

The safetensors file is serialized here rather than by ``safetensors.torch.save_file`` so that
(a) per-sample tensors are written straight from their buffers without first concatenating them
(which would double peak memory), (b) the sha256 is computed on the bytes as they are written,
and (c) the exact file size is known from the spec and token counts alone, which makes the disk
preflight exact (``shard_file_bytes``). The files are standard safetensors; any reader loads them.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from eagle3.features.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8
from eagle3.features.spec import CapturedSample, FeatureSpec, SampleTokens
from infra.storage import atomic_path, atomic_write_json, sha256_file, sha256_json

SHARD_RE = re.compile(r"^shard-(\d{5,})\.done\.json$")
DONE_SUFFIX = ".done.json"
ST_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", FP8_DTYPE: "F8_E4M3",
                  torch.int32: "I32", torch.uint8: "U8", torch.int64: "I64"}
HEADER_ALIGN = 8
"""Payload starts on an 8-byte boundary; tensors are ordered by element size so each stays aligned."""
WRITE_CHUNK_BYTES = 64 << 20
"""Unit of the write/hash pipeline."""

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


def check_against_request(samples: Sequence[CapturedSample], requested: Sequence[SampleTokens]) -> None:
    """The backend echoed exactly the requested ids, in order, with the requested tokens."""
    got, want = [s.id for s in samples], [r.id for r in requested]
    if got != want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        first = next((g for g, w in zip(got, want) if g != w), None)
        raise ShardValidationError(first, f"backend returned ids out of order or wrong (missing {missing[:5]}, "
                                          f"unexpected {extra[:5]}, {len(got)} returned for {len(want)} requested)")
    for sample, req in zip(samples, requested):
        if sample.input_ids.tolist() != list(req.input_ids):
            raise ShardValidationError(sample.id, "input_ids differ from the requested tokens")
        if sample.loss_mask.tolist() != list(req.loss_mask):
            raise ShardValidationError(sample.id, "loss_mask differs from the requested mask")


def validate_samples(spec: FeatureSpec, samples: Sequence[CapturedSample],
                     requested: Sequence[SampleTokens] | None = None) -> None:
    """Everything write_shard checks before writing a byte (ids unique, request echoed, each sample sound)."""
    if not samples:
        raise ShardValidationError(None, "a shard needs at least one sample")
    seen: set[str] = set()
    for sample in samples:
        if sample.id in seen:
            raise ShardValidationError(sample.id, "duplicate sample id in one shard")
        seen.add(sample.id)
    if requested is not None:
        check_against_request(samples, requested)
    for sample in samples:
        check_sample(spec, sample)


# ---- writing ----------------------------------------------------------------------------------


def _cast_sample(spec: FeatureSpec, sample: CapturedSample) -> dict[str, torch.Tensor]:
    """One sample's tensors in storage dtypes, on the CPU, contiguous."""
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
    out["input_ids"] = sample.input_ids.detach().to("cpu", torch.int32)
    out["loss_mask"] = sample.loss_mask.detach().to("cpu", torch.uint8)
    for name in ("aux", "final"):  # a cast to fp16 can overflow values that were finite in fp32
        if name in out and out[name].dtype == torch.float16:
            _check_finite(sample.id, name, out[name])
    return {k: v.contiguous() for k, v in out.items()}


def _collect_parts(spec: FeatureSpec, samples: Sequence[CapturedSample]) -> dict[str, list[torch.Tensor]]:
    """Per tensor name, the list of per-sample pieces in sample order (plus the offsets tensor)."""
    parts: dict[str, list[torch.Tensor]] = {}
    lengths = [0]
    for sample in samples:
        for name, tensor in _cast_sample(spec, sample).items():
            parts.setdefault(name, []).append(tensor)
        lengths.append(int(sample.input_ids.shape[0]))
    parts["offsets"] = [torch.tensor(lengths, dtype=torch.int64).cumsum(0)]  # [S + 1]
    return parts


def _chunks(views: list[memoryview]) -> Iterator[memoryview]:
    for view in views:
        for start in range(0, view.nbytes, WRITE_CHUNK_BYTES):
            yield view[start:start + WRITE_CHUNK_BYTES]


def _write_streamed(path: Path, header: bytes, order: list[str],
                    parts: dict[str, list[torch.Tensor]]) -> tuple[int, str]:
    """Write header + parts to a temp file, hash as we go, fsync and rename; returns (bytes, sha256).

    sha256 runs on its own thread (hashlib and file writes both release the GIL), so hashing a
    multi-GB shard costs about nothing on top of writing it.
    """
    digest = hashlib.sha256()
    views = [memoryview(header)] + [_as_bytes(t) for name in order for t in parts[name]]
    num_bytes = 0
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh, ThreadPoolExecutor(1, thread_name_prefix="sha256") as hasher:
            hashed = []
            for chunk in _chunks(views):
                hashed.append(hasher.submit(digest.update, chunk))  # one worker: chunks hash in order
                fh.write(chunk)
                num_bytes += chunk.nbytes
            for future in hashed:
                future.result()
    return num_bytes, digest.hexdigest()


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (works for bf16 and fp8, which numpy lacks)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _check_layout(layout: Layout, parts: dict[str, list[torch.Tensor]]) -> None:
    """The pieces add up to exactly the tensors the header announces (else the file would be corrupt)."""
    if set(layout) != set(parts):
        raise AssertionError(f"shard tensors {sorted(parts)} != layout {sorted(layout)}")
    for name, (dtype, shape) in layout.items():
        num = sum(p.numel() for p in parts[name])
        if any(p.dtype != dtype for p in parts[name]) or num * dtype.itemsize != _nbytes(dtype, shape):
            raise AssertionError(f"shard tensor {name}: pieces do not match {ST_DTYPE_NAMES[dtype]} {list(shape)}")


def write_shard(path: Path, spec: FeatureSpec, samples: Sequence[CapturedSample],
                requested: Sequence[SampleTokens] | None = None) -> dict[str, Any]:
    """Validate, write ``path`` (safetensors) atomically, then its done file; returns the done document.

    ``requested`` (the samples that were sent to the backend) adds the echo check: same ids in the
    same order and the same tokens, so states can never be filed under the wrong sample.
    """
    path = Path(path)
    validate_samples(spec, samples, requested)
    ids = [s.id for s in samples]
    num_tokens = sum(int(s.input_ids.shape[0]) for s in samples)
    parts = _collect_parts(spec, samples)
    layout = shard_layout(spec, num_tokens, len(samples))
    _check_layout(layout, parts)
    if int(parts["offsets"][0][-1]) != num_tokens:
        raise AssertionError("offsets do not end at the token count")
    done = done_path_for(path)
    done.unlink(missing_ok=True)  # an old done file must never vouch for the new bytes
    num_bytes, digest = _write_streamed(path, encode_header(layout, shard_metadata(spec, ids)), _ordered(layout), parts)
    doc = {"format_version": spec.format_version, "file": path.name, "sample_ids": ids, "num_samples": len(ids),
           "num_tokens": num_tokens, "num_loss_tokens": int(sum(int(p.sum()) for p in parts["loss_mask"])),
           "num_bytes": num_bytes, "sha256": digest, "spec_hash": spec_hash(spec)}
    atomic_write_json(done, doc)
    return doc


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


class ShardReader:
    """Random access to the samples of the complete shards of a features directory, memory-mapped.

    Tensors are read with ``safetensors.safe_open`` slices, so ``get`` touches only that sample's
    rows; nothing is loaded up front except the done documents and offsets.
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
        """Recompute the shard file's sha256 and compare it with its done document."""
        return sha256_file(shard_path(self.features_dir, shard_index)) == self.shards[shard_index]["sha256"]

    def close(self) -> None:
        """Drop the open file handles (and their mappings)."""
        self._handles.clear()
