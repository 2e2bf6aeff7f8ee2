"""The capture plan: which samples go into which shard, fixed before any forward runs.

Shards are filled greedily in tokenized.parquet row order (both splits: val rows are captured
too) up to ``capture.tokens_per_shard`` tokens; a sample longer than that gets a shard of its
own. Because row order and token counts are all the plan depends on, planning the same
tokenized file again gives the same plan byte for byte, and a shard index always names the same
samples: a restarted capture recomputes exactly the shards that are missing.

Each shard is a contiguous row range of tokenized.parquet, so a shard task reads only the row
groups it needs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3.features.shards.layout import shard_file_bytes
from eagle3.features.spec import FeatureSpec
from eagle3.run.layout import PLAN_FILE  # noqa: F401 (the plan's file name; its readers import it from here)
from eagle3.run.slices import split_balanced
from infra.storage import atomic_write_json, check_free_space

PLAN_FORMAT_VERSION = 1
DONE_FILE_ALLOWANCE_BYTES = 1024
"""Bytes allowed per shard for its done.json on top of the sample ids it lists."""


@dataclass(frozen=True)
class ShardPlan:
    """One shard: its samples (tokenized rows row_start..row_end-1) and their total tokens."""

    index: int
    sample_ids: list[str]
    num_tokens: int
    row_start: int
    row_end: int


@dataclass(frozen=True)
class CaptureSummary:
    """A prepared capture in counts: shards, samples, tokens, and which shards are still to capture."""

    num_shards: int
    num_samples: int
    num_tokens: int
    tokens_per_shard: int
    num_pending: int
    pending: list[int]
    """Indices of the shards not complete on disk."""
    num_tokens_pending: int
    num_bytes_pending: int | None
    """Bytes the pending shards will write (None when not computed)."""

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (the field names as keys)."""
        return asdict(self)


@dataclass(frozen=True)
class CapturePlan:
    """All shards of a capture, plus what they were planned from."""

    shards: list[ShardPlan]
    tokenized_key: str
    tokens_per_shard: int
    format_version: int = PLAN_FORMAT_VERSION
    pending: tuple[int, ...] | None = field(default=None, compare=False)
    """Shards not complete on disk when prepare_capture looked (not saved in plan.json)."""
    num_bytes_pending: int | None = field(default=None, compare=False)
    """Bytes the pending shards will write (not saved in plan.json)."""

    @property
    def num_samples(self) -> int:
        """Samples over all shards."""
        return sum(len(s.sample_ids) for s in self.shards)

    @property
    def num_tokens(self) -> int:
        """Tokens over all shards."""
        return sum(s.num_tokens for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (what plan.json holds: the plan only, no disk state)."""
        doc = asdict(self)
        del doc["pending"], doc["num_bytes_pending"]
        return {**doc, "num_samples": self.num_samples, "num_tokens": self.num_tokens}

    def summary(self) -> CaptureSummary:
        """Counts for progress displays; ``pending`` lists shard indices still to capture."""
        pending = list(self.pending) if self.pending is not None else [s.index for s in self.shards]
        todo = set(pending)
        return CaptureSummary(
            len(self.shards),
            self.num_samples,
            self.num_tokens,
            self.tokens_per_shard,
            len(pending),
            pending,
            sum(s.num_tokens for s in self.shards if s.index in todo),
            self.num_bytes_pending,
        )

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> CapturePlan:
        """Inverse of to_json."""
        shards = [ShardPlan(**s) for s in doc["shards"]]
        return cls(shards, doc["tokenized_key"], doc["tokens_per_shard"], doc.get("format_version", 1))

    def save(self, path: Path) -> Path:
        """Write plan.json atomically."""
        return atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: Path) -> CapturePlan:
        """Read plan.json."""
        return cls.from_json(json.loads(Path(path).read_text()))


def plan_shards(sample_ids: Sequence[str], num_tokens: Sequence[int], tokens_per_shard: int) -> list[ShardPlan]:
    """Greedy in order: close a shard when the next sample would push it past the budget."""
    shards: list[ShardPlan] = []
    start, total = 0, 0
    for row, num in enumerate(num_tokens):
        if row > start and total + num > tokens_per_shard:
            shards.append(ShardPlan(len(shards), list(sample_ids[start:row]), total, start, row))
            start, total = row, 0
        total += num
    if len(num_tokens) > start:
        shards.append(ShardPlan(len(shards), list(sample_ids[start:]), total, start, len(num_tokens)))
    return shards


def split_slices(shards: Sequence[ShardPlan], pending: Sequence[int], num_slices: int) -> list[list[int]]:
    """Split the pending shard indices into at most ``num_slices`` disjoint lists of about equal tokens.

    Largest shard first onto the slice with the fewest tokens so far (eagle3.run.slices.split_balanced), so no slice
    exceeds an even split by more than one shard; each list is in shard order, empty slices are dropped."""
    tokens = {s.index: s.num_tokens for s in shards}
    unknown = sorted(set(pending) - set(tokens))
    if unknown:
        raise ValueError(f"pending shards {unknown[:5]} are not in the plan ({len(tokens)} shards)")
    return split_balanced({index: tokens[index] for index in sorted(set(pending))}, num_slices)


def build_plan(tokenized: Path, tokens_per_shard: int, tokenized_key: str) -> CapturePlan:
    """Plan the shards of every row (train and val) of tokenized.parquet."""
    from eagle3.data.tokenize import read_tokenized

    table = read_tokenized(tokenized, columns=["id", "num_tokens"])
    ids = table["id"].to_pylist()
    if len(set(ids)) != len(ids):
        raise ValueError(f"{tokenized}: sample ids are not unique; cannot plan a capture")
    if not ids:
        raise ValueError(f"{tokenized} has no rows: nothing to capture")
    return CapturePlan(
        plan_shards(ids, table["num_tokens"].to_pylist(), tokens_per_shard), tokenized_key, tokens_per_shard
    )


def shard_bytes(shard: ShardPlan, spec: FeatureSpec) -> int:
    """Bytes one planned shard will take: the exact safetensors size plus its done file."""
    ids_json = len(json.dumps(shard.sample_ids, indent=2, ensure_ascii=False).encode("utf-8"))
    return shard_file_bytes(spec, shard.sample_ids, shard.num_tokens) + ids_json + DONE_FILE_ALLOWANCE_BYTES


def preflight_bytes(plan: CapturePlan, spec: FeatureSpec, skip: Sequence[int] = ()) -> int:
    """Bytes the plan writes (tokens x spec.bytes_per_token() + headers), leaving out shards in ``skip``."""
    done = set(skip)
    return sum(shard_bytes(s, spec) for s in plan.shards if s.index not in done)


ONLINE_HINT = (
    "offline capture does not fit; train.features=online needs no feature disk (the target runs inside "
    "each training step, whole on each training GPU or FSDP2-sharded across them: train.target_sharding)"
)


def check_disk(features_dir: Path, need_bytes: int, margin_bytes: int) -> int:
    """Raise infra.storage.DiskSpaceError (naming need, margin and free bytes, and the mode that fits) unless it
    fits; returns free bytes."""
    from infra.storage import DiskSpaceError

    try:
        return check_free_space(features_dir, need_bytes, margin_bytes)
    except DiskSpaceError as exc:
        raise DiskSpaceError(f"{exc}; {ONLINE_HINT}") from None
