"""Stage completeness: a stage is done when its manifest exists and matches its inputs.

The match key hashes (a) the stage's format version, bumped when the meaning of its output
changes, (b) its config sections, (c) the manifests of its input stages (which carry their
outputs' sha256) and (d) any extra facts such as the target fingerprint. It never hashes source
code: editing a comment must not force hours of capture or training again. Prefect's cache key
for the stage's task is this same key.

The manifest is written last and atomically, after every output file, so a stage killed
half-way has no manifest and runs again. Completeness is checked by content: a manifest counts only
while every output it names has the recorded size and sha256 (hashed once per process and file
version, ``sha256_file_cached``), so a flipped byte makes the stage run again. A downstream stage's
key reads its input manifests the same way and stops with ``CorruptOutputError`` naming the file when
an input no longer matches: that data was already consumed, and only its own stage may redo it. A
stage that runs removes the temp files a killed earlier run of it left beside its outputs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.run.layout import manifest_name
from infra.storage import atomic_write_json, remove_stale_temps, sha256_file_cached, sha256_json

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageId:
    """A stage as the run directory knows it: its name, the folder its outputs and manifest go to, and the format
    version of its output (part of its key; bump it when the output changes meaning, and every run redoes the
    stage). Each stage module declares its own (eagle3.run.registry lists the modules)."""

    name: str
    folder: str
    version: int = 1

    def manifest(self, run_dir: Path) -> Path:
        """<run_dir>/<folder>/<name>.manifest.json: written last, it says the stage is complete."""
        return Path(run_dir) / self.folder / manifest_name(self.name)


StageRef = StageId | str
"""A stage as the primitives below take it; a bare name stands for format version 1 (tests, tools)."""


def _id(stage: StageRef) -> StageId:
    return stage if isinstance(stage, StageId) else StageId(stage, "", 1)


class MissingInputError(ValueError):
    """A stage was asked to run before the stage it reads from completed."""


class CorruptOutputError(ValueError):
    """A completed stage's output no longer matches the size or sha256 its manifest records."""


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
        """JSON-able dict (what the command lines print and the flows return)."""
        return {
            "stage": self.stage,
            "key": self.key,
            "manifest": str(self.manifest),
            "computed": self.computed,
            "stats": self.stats,
            "outputs": self.outputs,
        }

    @classmethod
    def from_manifest(cls, stage: str, key: str, manifest: Path, doc: dict[str, Any], computed: bool) -> StageOutcome:
        """The outcome that manifest ``doc`` (read from ``manifest``) records, its outputs as full paths."""
        outputs = {k: str(Path(manifest).parent / v["path"]) for k, v in doc["outputs"].items()}
        return cls(stage, key, Path(manifest), computed, doc["stats"], outputs)


def stage_key(
    stage: StageRef, config: dict[str, Any], inputs: Sequence[Path] = (), extra: dict[str, Any] | None = None
) -> str:
    """Hash of everything a stage's output depends on (see module doc)."""
    stage = _id(stage)
    input_docs = []
    for path in inputs:
        doc = read_manifest(Path(path))
        if doc is None:
            raise MissingInputError(
                f"stage {stage.name} needs {Path(path).name.split('.')[0]} to be complete first (no manifest at {path})"
            )
        problem = output_problem(doc, Path(path))
        if problem:
            raise CorruptOutputError(
                f"stage {stage.name} reads the output of stage {doc.get('stage')}, but {problem}; "
                f"run stage {doc.get('stage')} again (it recomputes on its next run)"
            )
        input_docs.append({"stage": doc["stage"], "key": doc["key"], "outputs": doc["outputs"]})
    return sha256_json(
        {"stage": stage.name, "version": stage.version, "config": config, "inputs": input_docs, "extra": extra or {}}
    )


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest as a dict, or None if absent or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def output_problem(doc: dict[str, Any], manifest: Path) -> str | None:
    """Why the outputs a manifest names are not the ones it recorded (missing, size, sha256), or None."""
    base = Path(manifest).parent
    for entry in doc.get("outputs", {}).values():
        path = base / entry["path"]
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != entry.get("bytes"):
            return f"{path} has {size} bytes where {Path(manifest).name} recorded {entry.get('bytes')}"
        digest = sha256_file_cached(path)
        if digest != entry.get("sha256"):
            return (
                f"{path} has sha256 {digest[:16]}..., not the {str(entry.get('sha256'))[:16]}... "
                f"recorded in {Path(manifest).name} (changed or corrupted on disk)"
            )
    return None


def manifest_matches(path: Path, key: str) -> bool:
    """True when the manifest exists, has this key, and its outputs are on disk with the recorded size and sha256."""
    doc = read_manifest(path)
    if not doc or doc.get("key") != key:
        return False
    problem = output_problem(doc, Path(path))
    if problem:
        log.warning("%s: %s; the stage runs again", doc.get("stage"), problem)
    return problem is None


def write_manifest(path: Path, stage: StageRef, key: str, outputs: dict[str, Path], stats: dict[str, Any]) -> dict:
    """Record outputs (relative path, bytes, sha256) and stats; written last, atomically."""
    stage = _id(stage)
    base = Path(path).parent
    entries = {
        name: {"path": str(Path(p).relative_to(base)), "bytes": Path(p).stat().st_size, "sha256": sha256_file_cached(p)}
        for name, p in outputs.items()
    }
    doc = {
        "stage": stage.name,
        "key": key,
        "format_version": stage.version,
        "outputs": entries,
        "stats": stats,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    atomic_write_json(path, doc)
    return doc


def _own_files(manifest: Path, doc: dict[str, Any] | None) -> list[Path]:
    """The manifest and the outputs its previous version names: whose temp files a killed run of this stage left."""
    entries = (doc or {}).get("outputs", {}).values() if isinstance(doc, dict) else []
    return [manifest, *(manifest.parent / e["path"] for e in entries if isinstance(e, dict) and "path" in e)]


ComputeFn = Callable[[], tuple[dict[str, Path], dict[str, Any]]]


def skipped_outcome(
    stage: StageRef, manifest: Path, key: str, complete: Callable[[], bool] | None = None
) -> StageOutcome | None:
    """The outcome of a stage that is up to date (its manifest matches ``key``, and ``complete()`` holds when
    given: what else must be intact), logged as skipped; None when the stage has to run."""
    if not manifest_matches(manifest, key) or (complete is not None and not complete()):
        return None
    name = _id(stage).name
    log.info("%s: up to date (%s), skipped", name, manifest)
    doc = read_manifest(manifest)
    assert doc is not None  # (manifest_matches read it)
    return StageOutcome.from_manifest(name, key, manifest, doc, computed=False)


def run_stage(stage: StageRef, manifest: Path, key: str, compute: ComputeFn, force: bool = False) -> StageOutcome:
    """Run ``compute`` unless an up-to-date manifest exists; ``compute`` returns (outputs, stats)."""
    skipped = None if force else skipped_outcome(stage, manifest, key)
    if skipped is not None:
        return skipped
    started_ns = time.time_ns()
    remove_stale_temps(_own_files(manifest, read_manifest(manifest)))  # nothing of this run exists yet
    manifest.unlink(missing_ok=True)
    outputs, stats = compute()
    # A first run killed mid-write had no manifest to name its files; now the outputs do.
    remove_stale_temps([manifest, *outputs.values()], older_than_ns=started_ns)
    write_manifest(manifest, stage, key, outputs, stats)
    return StageOutcome(_id(stage).name, key, manifest, True, stats, {k: str(v) for k, v in outputs.items()})
