"""ShardReader: random access to the samples of a features directory's complete shards, memory-mapped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagle3.features.fp8 import dequantize_fp8
from eagle3.features.shards.done import ShardDone, complete_shards
from eagle3.features.shards.layout import done_path_for, shard_path, shard_stem, spec_hash
from eagle3.features.spec import FeatureSpec
from infra.storage import sha256_file_cached


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
        self.shards: dict[int, ShardDone] = complete_shards(self.features_dir, self.spec_hash)
        self._where: dict[str, tuple[int, int]] = {}
        for index, doc in self.shards.items():
            for position, sample_id in enumerate(doc.sample_ids):
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
        return sum(doc.num_tokens for doc in self.shards.values())

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            from safetensors import safe_open

            if not self.verify(index):
                path, done = shard_path(self.features_dir, index), done_path_for(shard_path(self.features_dir, index))
                raise CorruptShardError(
                    f"{path} does not match the sha256 in {done.name} (corrupted on disk); "
                    f"delete {done} and run the capture again, which recaptures that shard"
                )
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
        names = [name for name in handle.keys() if name not in ("offsets", "aux_scale")]  # noqa: SIM118 (safetensors' safe_open has keys() but is not iterable: `in fh` raises)
        out = {name: handle.get_slice(name)[begin:end] for name in names}
        if "aux_scale" in handle.keys():  # noqa: SIM118 (safetensors' safe_open has keys() but is not iterable: `in fh` raises)
            out["aux"] = dequantize_fp8(out["aux"], handle.get_slice("aux_scale")[begin:end], torch.bfloat16)
        return out

    def verify(self, shard_index: int) -> bool:
        """The shard file's sha256 (hashed once per process and file version) equals its done document's."""
        return sha256_file_cached(shard_path(self.features_dir, shard_index)) == self.shards[shard_index].sha256

    def close(self) -> None:
        """Drop the open file handles (and their mappings)."""
        self._handles.clear()
