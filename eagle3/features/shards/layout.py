"""Where a shard lives and how its bytes are laid out: file names, spec hash, tensor layout, header.

Everything here follows from the spec and the request alone (no tensor data), so the disk preflight
(``shard_file_bytes``) and the writer's offsets are exact before a byte is written.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eagle3.features.fp8 import FP8_DTYPE
from eagle3.features.spec import FeatureSpec
from infra.storage import sha256_json

SHARD_RE = re.compile(r"^shard-(\d{5,})\.done\.json$")
DONE_SUFFIX = ".done.json"
ST_DTYPE_NAMES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    FP8_DTYPE: "F8_E4M3",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.int64: "I64",
}
HEADER_ALIGN = 8
"""Payload starts on an 8-byte boundary; tensors are ordered by element size so each stays aligned."""

Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]


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


def storage_dtype(name: str) -> torch.dtype:
    """The torch dtype a spec dtype name is stored as."""
    return FP8_DTYPE if name == "float8_e4m3fn" else getattr(torch, name)


def shard_layout(spec: FeatureSpec, num_tokens: int, num_samples: int) -> Layout:
    """Name -> (dtype, shape) of every tensor a shard of this spec holds (see spec.py's module doc)."""
    t, h = num_tokens, spec.hidden_size
    layout: Layout = {"aux": (storage_dtype(spec.aux_dtype), (t, spec.num_aux * h))}
    if spec.aux_dtype == "float8_e4m3fn":
        layout["aux_scale"] = (torch.float32, (t,))
    if spec.supervision == "final_hidden":
        layout["final"] = (storage_dtype(spec.dtype), (t, h))
    else:
        layout["topk_ids"] = (torch.int32, (t, spec.topk or 0))
        layout["topk_logprobs"] = (torch.float32, (t, spec.topk or 0))
    layout["input_ids"] = (torch.int32, (t,))
    layout["loss_mask"] = (torch.uint8, (t,))
    layout["offsets"] = (torch.int64, (num_samples + 1,))
    return layout


def file_order(layout: Layout) -> list[str]:
    """Tensor names in file order: largest element size first (then by name) keeps every tensor aligned."""
    return sorted(layout, key=lambda n: (-layout[n][0].itemsize, n))


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of this dtype and shape."""
    num = 1
    for dim in shape:
        num *= dim
    return num * dtype.itemsize


def shard_metadata(spec: FeatureSpec, sample_ids: Sequence[str]) -> dict[str, str]:
    """The safetensors __metadata__ (strings only): enough to identify the shard without its done file."""
    return {
        "format_version": str(spec.format_version),
        "spec_hash": spec_hash(spec),
        "sample_ids": json.dumps(list(sample_ids), ensure_ascii=False),
        "aux_layer_ids": json.dumps(spec.aux_layer_ids),
        "aux_convention": spec.aux_convention,
    }


def encode_header(layout: Layout, metadata: dict[str, str]) -> bytes:
    """8-byte little-endian length + JSON header padded with spaces to HEADER_ALIGN."""
    header: dict[str, Any] = {"__metadata__": metadata}
    begin = 0
    for name in file_order(layout):
        dtype, shape = layout[name]
        end = begin + nbytes(dtype, shape)
        header[name] = {"dtype": ST_DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [begin, end]}
        begin = end
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-(8 + len(text)) % HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text


def shard_file_bytes(spec: FeatureSpec, sample_ids: Sequence[str], num_tokens: int) -> int:
    """Exact size of the safetensors file for these samples (header included)."""
    layout = shard_layout(spec, num_tokens, len(sample_ids))
    payload = sum(nbytes(dtype, shape) for dtype, shape in layout.values())
    return len(encode_header(layout, shard_metadata(spec, sample_ids))) + payload
