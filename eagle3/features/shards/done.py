"""The done file (``shard-NNNNN.done.json``), written last: it vouches for one shard's safetensors file.

A shard is complete when its done file loads, names the expected spec hash and records the
safetensors file's exact size; the sha256 it records is checked by the reader on first open.
"""

from __future__ import annotations

import json
import typing
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from eagle3.features.shards.layout import DONE_SUFFIX, SHARD_RE, shard_path


@dataclass(frozen=True)
class ShardDone:
    """One shard's done document; its JSON keys are the field names."""

    format_version: int  # FeatureSpec.format_version the shard was written with
    file: str  # the safetensors file's name, beside the done file
    sample_ids: list[str]  # in shard order
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    num_bytes: int  # exact size of the safetensors file
    sha256: str  # of the whole safetensors file
    spec_hash: str  # layout.spec_hash of the spec it was written for

    def to_json(self) -> dict[str, Any]:
        """The JSON document (a fresh dict)."""
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Any) -> ShardDone:
        """A done document read back; ValueError naming the keys or types that differ from the fields."""
        if not isinstance(doc, dict):
            raise ValueError(f"a done document is a JSON object, got {type(doc).__name__}")
        names = [f.name for f in fields(cls)]
        missing, extra = [n for n in names if n not in doc], sorted(set(doc) - set(names))
        if missing or extra:
            raise ValueError(f"done document keys differ (missing {missing}, unexpected {extra})")
        hints = typing.get_type_hints(cls)
        wrong = [n for n in names if not _has_type(doc[n], hints[n])]
        if wrong:
            raise ValueError(f"done document fields of the wrong type: {wrong}")
        return cls(**{n: doc[n] for n in names})


def _has_type(value: Any, hint: Any) -> bool:
    """JSON value of a field type: int (not bool), str, or list[str]."""
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def read_done(done_path: Path) -> ShardDone | None:
    """A done document, or None when absent, unreadable or not a done document (the shard is then incomplete)."""
    try:
        return ShardDone.from_json(json.loads(Path(done_path).read_text()))
    except (OSError, ValueError):
        return None


def shard_is_complete(st_path: Path, doc: ShardDone | None, expected_spec_hash: str) -> bool:
    """Done file present for this spec and the safetensors file has exactly the recorded size."""
    if doc is None or doc.spec_hash != expected_spec_hash:
        return False
    st_path = Path(st_path)
    return st_path.is_file() and st_path.stat().st_size == doc.num_bytes


def complete_shards(features_dir: Path, expected_spec_hash: str) -> dict[int, ShardDone]:
    """Index -> done document of every complete shard in the directory (temp files never match)."""
    found: dict[int, ShardDone] = {}
    for done in sorted(Path(features_dir).glob(f"shard-*{DONE_SUFFIX}")):
        match = SHARD_RE.match(done.name)
        if not match:
            continue
        doc = read_done(done)
        index = int(match.group(1))
        if doc is not None and shard_is_complete(shard_path(features_dir, index), doc, expected_spec_hash):
            found[index] = doc
    return found
