"""Stage completeness: a stage is done when its manifest exists and matches its inputs.

The match key hashes (a) the stage's format version, bumped when the meaning of its output
changes, (b) its config sections, (c) the manifests of its input stages (which carry their
outputs' sha256) and (d) any extra facts such as the target fingerprint. It never hashes source
code: editing a comment must not force hours of capture or training again. Prefect's cache key
for the stage's task is this same key.

The manifest is written last and atomically, after every output file, so a stage killed
half-way has no manifest and runs again; a manifest whose outputs were deleted or changed
size does not count either.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.storage import atomic_write_json, sha256_file, sha256_json

log = logging.getLogger(__name__)

FORMAT_VERSIONS: dict[str, int] = {"merge": 1, "regenerate": 1, "tokenize": 1, "vocab": 1, "capture": 1, "train": 1,
                                   "export": 1, "evaluate": 1, "deploy": 1}
"""Bump a stage's number when its output's meaning changes; every run recomputes it then."""


class MissingInputError(ValueError):
    """A stage was asked to run before the stage it reads from completed."""


@dataclass(frozen=True)
class StageOutcome:
    """What a stage call did: where its manifest is, and whether it computed or found it complete."""

    stage: str
    key: str
    manifest: Path
    computed: bool
    stats: dict[str, Any]
    outputs: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (what Prefect tasks return)."""
        return {"stage": self.stage, "key": self.key, "manifest": str(self.manifest), "computed": self.computed,
                "stats": self.stats, "outputs": self.outputs}


def stage_key(stage: str, config: dict[str, Any], inputs: list[Path] = (), extra: dict[str, Any] | None = None) -> str:
    """Hash of everything a stage's output depends on (see module doc)."""
    input_docs = []
    for path in inputs:
        doc = read_manifest(Path(path))
        if doc is None:
            raise MissingInputError(f"stage {stage} needs {Path(path).name.split('.')[0]} to be complete first "
                                    f"(no manifest at {path})")
        input_docs.append({"stage": doc["stage"], "key": doc["key"], "outputs": doc["outputs"]})
    return sha256_json({"stage": stage, "version": FORMAT_VERSIONS[stage], "config": config,
                        "inputs": input_docs, "extra": extra or {}})


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest as a dict, or None if absent or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _outputs_intact(doc: dict[str, Any], base: Path) -> bool:
    for entry in doc.get("outputs", {}).values():
        path = base / entry["path"]
        if not path.is_file() or path.stat().st_size != entry["bytes"]:
            return False
    return True


def manifest_matches(path: Path, key: str) -> bool:
    """True when the manifest exists, has this key, and its outputs are on disk with the recorded sizes."""
    doc = read_manifest(path)
    return bool(doc) and doc.get("key") == key and _outputs_intact(doc, Path(path).parent)


def write_manifest(path: Path, stage: str, key: str, outputs: dict[str, Path], stats: dict[str, Any]) -> dict:
    """Record outputs (relative path, bytes, sha256) and stats; written last, atomically."""
    base = Path(path).parent
    entries = {
        name: {"path": str(Path(p).relative_to(base)), "bytes": Path(p).stat().st_size, "sha256": sha256_file(p)}
        for name, p in outputs.items()
    }
    doc = {"stage": stage, "key": key, "format_version": FORMAT_VERSIONS[stage], "outputs": entries,
           "stats": stats, "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    atomic_write_json(path, doc)
    return doc


ComputeFn = Callable[[], tuple[dict[str, Path], dict[str, Any]]]


def run_stage(stage: str, manifest: Path, key: str, compute: ComputeFn, force: bool = False) -> StageOutcome:
    """Run ``compute`` unless an up-to-date manifest exists; ``compute`` returns (outputs, stats)."""
    if not force and manifest_matches(manifest, key):
        doc = read_manifest(manifest)
        log.info("%s: up to date (%s), skipped", stage, manifest)
        outputs = {k: str(manifest.parent / v["path"]) for k, v in doc["outputs"].items()}
        return StageOutcome(stage, key, manifest, False, doc["stats"], outputs)
    manifest.unlink(missing_ok=True)
    outputs, stats = compute()
    write_manifest(manifest, stage, key, outputs, stats)
    return StageOutcome(stage, key, manifest, True, stats, {k: str(v) for k, v in outputs.items()})
