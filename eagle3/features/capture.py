"""The capture stage: target hidden states of every tokenized sample, in resumable, validated shards.

    prepare_capture   spec.json (refused if an existing one differs: eagle3.features.run_spec), plan.json,
                      stale-shard cleanup, disk preflight for the shards still to write
    capture_shard     one shard: skip if its done file matches, else tokens -> backend -> shard file
    finalize_capture  every planned shard complete -> features/capture.manifest.json
    run_capture       all three in sequence (what ``python -m eagle3.features.capture`` runs)

Both capture paths go through ``writers.capture_and_write``, so a shard's rows are written while its
forwards (and the next shard's) run. Prefect runs the same three functions as tasks (one task per
shard). Completion lives on disk, in each shard's done file, so a killed run resumes by recapturing
only the shards without one; the shards of a resumed run are byte-identical to those of an
uninterrupted one (same plan, same batches, deterministic forwards, any number of writers).

    python -m eagle3.features.capture --preset tiny
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeGuard

from eagle3.config import RunConfig, section_dict
from eagle3.data.stages import tokenize
from eagle3.features import ONLINE_SKIP, STAGE
from eagle3.features.plan import PLAN_FILE, CapturePlan, ShardPlan, build_plan, check_disk, preflight_bytes
from eagle3.features.run_spec import build_spec, save_or_check_spec
from eagle3.features.shards.done import ShardDone, complete_shards, read_done, shard_is_complete
from eagle3.features.shards.layout import SHARD_RE, done_path_for, shard_path, shard_stem, spec_hash
from eagle3.features.spec import CaptureBackend, FeatureSpec, SampleTokens
from eagle3.features.writers import WriteOptions, WriteStats, capture_and_write
from eagle3.run.layout import SPEC_FILE, manifest_name, run_layout
from eagle3.run.progress import Progress, ProgressFn
from eagle3.run.stage import StageOutcome, manifest_matches, skipped_outcome, stage_key, write_manifest

log = logging.getLogger(__name__)

SECTION = "capture"

ST_RE = re.compile(r"^shard-(\d{5,})\.safetensors$")
MANIFEST_FILE = manifest_name(STAGE.name)


def features_dir(cfg: RunConfig) -> Path:
    """<run>/features."""
    return run_layout(cfg).features


def _tokenized(cfg: RunConfig) -> tuple[Path, Path]:
    """(tokenized.parquet, its manifest); FileNotFoundError with the command to run when missing."""
    layout = run_layout(cfg)
    manifest = layout.manifest(tokenize.STAGE)
    if not manifest.is_file():
        raise FileNotFoundError(
            f"{manifest} not found: tokenize first (eagle3 stage {tokenize.STAGE.name}, same config)"
        )
    return layout.tokenized, manifest


def _tokenized_key(manifest: Path) -> str:
    return json.loads(manifest.read_text())["key"]


def capture_key(cfg: RunConfig, spec: FeatureSpec) -> str:
    """Stage key: capture config minus its operational fields, target dtype, tokenized manifest, target, spec."""
    _, manifest = _tokenized(cfg)
    conf = section_dict(cfg, SECTION)[SECTION] | {"target_dtype": cfg.target.dtype}
    return stage_key(STAGE, conf, [manifest], {"target": spec.target_fingerprint, "spec": spec_hash(spec)})


def _shard_matches(doc: ShardDone | None, shard: ShardPlan, fdir: Path, expected_hash: str) -> TypeGuard[ShardDone]:
    """The shard on disk is complete and holds exactly the planned samples."""
    return (
        doc is not None
        and shard_is_complete(shard_path(fdir, shard.index), doc, expected_hash)
        and doc.sample_ids == shard.sample_ids
        and doc.num_tokens == shard.num_tokens
    )


def _remove_stale(fdir: Path, plan: CapturePlan, expected_hash: str) -> list[str]:
    """Delete temp files of killed writers and shards that no longer match the plan (done file first)."""
    planned = {s.index: s for s in plan.shards}
    removed = []
    for tmp in fdir.glob(".shard-*.tmp"):
        tmp.unlink(missing_ok=True)
        removed.append(tmp.name)
    for done in fdir.glob("shard-*.done.json"):
        match = SHARD_RE.match(done.name)
        shard = planned.get(int(match.group(1))) if match else None
        if shard is None or not _shard_matches(read_done(done), shard, fdir, expected_hash):
            done.unlink(missing_ok=True)
            removed.append(done.name)
    for st in fdir.glob("shard-*.safetensors"):
        match = ST_RE.match(st.name)
        if match and int(match.group(1)) not in planned:
            st.unlink(missing_ok=True)
            removed.append(st.name)
    return removed


def prepare_capture(cfg: RunConfig, spec: FeatureSpec | None = None) -> CapturePlan:
    """Write spec.json and plan.json, drop stale shards, check the disk; returns the plan with pending shards.

    ``spec``: the run's FeatureSpec when the caller has built it already (it loads the tokenizer)."""
    from eagle3.target.load import prepare_target

    tokenized, manifest = _tokenized(cfg)
    fdir = features_dir(cfg)
    fdir.mkdir(parents=True, exist_ok=True)
    spec = spec or build_spec(cfg, prepare_target(cfg))
    save_or_check_spec(fdir, spec)
    plan = build_plan(tokenized, cfg.capture.tokens_per_shard, _tokenized_key(manifest))
    expected = spec_hash(spec)
    removed = _remove_stale(fdir, plan, expected)
    if removed:
        log.info("capture: removed %d stale files (%s)", len(removed), ", ".join(removed[:5]))
    plan.save(fdir / PLAN_FILE)
    on_disk = complete_shards(fdir, expected)
    pending = tuple(s.index for s in plan.shards if not _shard_matches(on_disk.get(s.index), s, fdir, expected))
    todo = set(pending)
    need = preflight_bytes(plan, spec, skip=[s.index for s in plan.shards if s.index not in todo])
    check_disk(fdir, need, cfg.capture.disk_margin_bytes)
    return CapturePlan(plan.shards, plan.tokenized_key, plan.tokens_per_shard, plan.format_version, pending, need)


def make_backend(cfg: RunConfig, model_dir: Path, spec: FeatureSpec | None = None) -> CaptureBackend:
    """The configured backend: in-process HF, or SGLang (imported only when asked for)."""
    spec = spec or build_spec(cfg, model_dir)
    cap = cfg.capture
    if cap.backend == "hf":
        from eagle3.features.hf_backend import HFCaptureBackend

        return HFCaptureBackend.from_spec(
            model_dir,
            spec,
            device=cap.device,
            dtype=cfg.target.dtype,
            tokens_per_forward=cap.tokens_per_forward,
            device_map=cap.device_map,
            pinned_handoff=cap.pinned_handoff,
            batch_invariant=cap.per_sample_attention,
        )
    from eagle3.features.sglang_backend import SGLangCaptureBackend

    # Which servers to use (given endpoints, or managed ones per pass) is the SGLang module's decision.
    return SGLangCaptureBackend.from_config(cfg, model_dir, spec)


def load_shard_samples(tokenized: Path, shard: ShardPlan) -> list[SampleTokens]:
    """The planned rows of one shard, reading only the row groups that hold them."""
    import pyarrow.parquet as pq

    source = pq.ParquetFile(tokenized)
    groups: list[int] = []
    first_row, row = 0, 0
    for g in range(source.metadata.num_row_groups):
        num = source.metadata.row_group(g).num_rows
        if row + num > shard.row_start and row < shard.row_end:
            first_row = row if not groups else first_row
            groups.append(g)
        row += num
    table = source.read_row_groups(groups, columns=["id", "input_ids", "loss_mask"])
    table = table.slice(shard.row_start - first_row, shard.row_end - shard.row_start)
    ids = table["id"].to_pylist()
    if ids != shard.sample_ids:
        raise ValueError(
            f"{tokenized} changed since plan.json was written ({shard_stem(shard.index)} expects "
            f"{shard.sample_ids[:3]}..., found {ids[:3]}...); run prepare_capture again"
        )
    return [
        SampleTokens(i, ids_, mask)
        for i, ids_, mask in zip(ids, table["input_ids"].to_pylist(), table["loss_mask"].to_pylist())
    ]


def _load_prepared(cfg: RunConfig) -> tuple[Path, FeatureSpec, CapturePlan]:
    fdir = features_dir(cfg)
    if not (fdir / SPEC_FILE).is_file() or not (fdir / PLAN_FILE).is_file():
        raise FileNotFoundError(f"{fdir} has no {SPEC_FILE}/{PLAN_FILE}: run prepare_capture first")
    return fdir, FeatureSpec.load(fdir / SPEC_FILE), CapturePlan.load(fdir / PLAN_FILE)


@dataclass(frozen=True)
class ShardResult:
    """What one shard call did: computed the shard here, or found it complete (then no time was spent)."""

    shard: int
    computed: bool
    num_tokens: int
    num_bytes: int
    elapsed_s: float = 0.0
    tokens_per_s: float = 0.0

    @classmethod
    def from_done(cls, shard: int, doc: ShardDone, computed: bool) -> ShardResult:
        """The counts a shard's done file records (no timing: it was not measured here)."""
        return cls(shard, computed, doc.num_tokens, doc.num_bytes)

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (the field names as keys)."""
        return asdict(self)


def capture_shard(cfg: RunConfig, shard_index: int, backend: CaptureBackend | None = None) -> ShardResult:
    """Capture one planned shard unless its done file already matches; returns counts and timing."""
    fdir, spec, plan = _load_prepared(cfg)
    shard = plan.shards[shard_index]
    path = shard_path(fdir, shard_index)
    doc = read_done(done_path_for(path))
    if _shard_matches(doc, shard, fdir, spec_hash(spec)):
        return ShardResult.from_done(shard_index, doc, computed=False)
    tokenized, manifest = _tokenized(cfg)
    if _tokenized_key(manifest) != plan.tokenized_key:
        raise ValueError(f"tokenized data changed since {fdir / PLAN_FILE} was written; run prepare_capture again")
    samples = load_shard_samples(tokenized, shard)
    start = time.perf_counter()
    own = backend is None
    if backend is None:
        from eagle3.target.load import prepare_target

        backend = make_backend(cfg, prepare_target(cfg), spec)
    try:
        (doc,) = capture_and_write(backend, spec, [(path, samples)], options=WriteOptions.from_config(cfg.capture))
    finally:
        if own:
            backend.close()
    elapsed_s = time.perf_counter() - start
    return ShardResult(
        shard_index,
        True,
        doc.num_tokens,
        doc.num_bytes,
        round(elapsed_s, 3),
        round(doc.num_tokens / max(elapsed_s, 1e-9), 1),
    )


def _incomplete(fdir: Path, spec: FeatureSpec, plan: CapturePlan) -> tuple[list[int], dict[int, ShardDone]]:
    expected = spec_hash(spec)
    on_disk = complete_shards(fdir, expected)
    missing = [s.index for s in plan.shards if not _shard_matches(on_disk.get(s.index), s, fdir, expected)]
    return missing, on_disk


def _stats(spec: FeatureSpec, plan: CapturePlan, docs: list[ShardDone]) -> dict[str, Any]:
    num_tokens = sum(d.num_tokens for d in docs)
    num_bytes = sum(d.num_bytes for d in docs)
    return {
        "num_shards": len(docs),
        "num_samples": sum(d.num_samples for d in docs),
        "num_tokens": num_tokens,
        "num_loss_tokens": sum(d.num_loss_tokens for d in docs),
        "num_bytes": num_bytes,
        "bytes_per_token": round(num_bytes / max(num_tokens, 1), 2),
        "spec_bytes_per_token": spec.bytes_per_token(),
        "spec_hash": spec_hash(spec),
        "aux_layer_ids": spec.aux_layer_ids,
        "supervision": spec.supervision,
        "aux_dtype": spec.aux_dtype,
        "tokens_per_shard": plan.tokens_per_shard,
    }


def finalize_capture(
    cfg: RunConfig, last_run: dict[str, Any] | None = None, known_key: str | None = None
) -> dict[str, Any]:
    """Check that every planned shard is complete, then write capture.manifest.json (last).

    ``last_run``: what the capture that completed the shards measured (time, tokens/s, writer waits);
    ``known_key``: the stage key when the caller computed it already (it is computed once per run of the stage).
    """
    fdir, spec, plan = _load_prepared(cfg)
    missing, on_disk = _incomplete(fdir, spec, plan)
    if missing:
        raise RuntimeError(
            f"{len(missing)} of {len(plan.shards)} capture shards are not complete "
            f"(first: {[shard_stem(i) for i in missing[:5]]}); run the capture again"
        )
    docs = [on_disk[s.index] for s in plan.shards]
    outputs = {"spec": fdir / SPEC_FILE, "plan": fdir / PLAN_FILE}
    # Done files carry each shard's size and sha256; hashing them (not terabytes of shards) is enough.
    outputs.update({shard_stem(s.index): done_path_for(shard_path(fdir, s.index)) for s in plan.shards})
    stats = _stats(spec, plan, docs) | ({"last_run": last_run} if last_run else {})
    return write_manifest(fdir / MANIFEST_FILE, STAGE, known_key or capture_key(cfg, spec), outputs, stats)


def finalize_outcome(
    cfg: RunConfig, last_run: dict[str, Any] | None = None, known_key: str | None = None
) -> StageOutcome:
    """finalize_capture as the stage's outcome (computed: the manifest was written now)."""
    doc = finalize_capture(cfg, last_run, known_key)
    return StageOutcome.from_manifest(STAGE.name, doc["key"], features_dir(cfg) / MANIFEST_FILE, doc, computed=True)


def is_complete(cfg: RunConfig, key: str) -> bool:
    """The manifest matches ``key`` and every shard file it vouches for is on disk with its size."""
    fdir = features_dir(cfg)
    if not manifest_matches(fdir / MANIFEST_FILE, key):
        return False
    return _shards_intact(cfg)


def _shards_intact(cfg: RunConfig) -> bool:
    """Every planned shard is on disk and complete (what a matching manifest vouches for)."""
    fdir, spec, plan = _load_prepared(cfg)
    return not _incomplete(fdir, spec, plan)[0]


def stage_key_of(cfg: RunConfig) -> str:
    """The capture key of ``cfg`` (prepares the target to build the feature spec)."""
    from eagle3.target.load import prepare_target

    return capture_key(cfg, build_spec(cfg, prepare_target(cfg)))


def is_captured(cfg: RunConfig) -> bool:
    """The capture of ``cfg`` is complete: manifest matching its key, every shard intact."""
    return (features_dir(cfg) / MANIFEST_FILE).is_file() and is_complete(cfg, stage_key_of(cfg))


def _capture_all(cfg: RunConfig, plan: CapturePlan, spec: FeatureSpec, progress: ProgressFn | None) -> dict[str, Any]:
    """Every pending shard in order with one backend (the model loads once), writes overlapping forwards.

    Returns this run's figures: shards and tokens captured, wall time (model load included), tokens/s, and how
    long the forwards waited for the writers."""
    from eagle3.target.load import prepare_target

    fdir, (tokenized, _) = features_dir(cfg), _tokenized(cfg)
    todo = set(plan.pending or ())
    pending = [s for s in plan.shards if s.index in todo]
    tokens_left = sum(s.num_tokens for s in pending)
    totals = {"tokens": 0, "bytes": 0}
    start = time.perf_counter()
    with Progress(len(plan.shards), "capture", progress) as bar:
        bar.update(len(plan.shards) - len(pending))  # complete before this run

        def written(doc: ShardDone) -> None:
            totals["tokens"] += doc.num_tokens
            totals["bytes"] += doc.num_bytes
            rate = totals["tokens"] / max(time.perf_counter() - start, 1e-9)
            bar.update(
                1,
                tokens=totals["tokens"],
                bytes=totals["bytes"],
                tokens_per_s=round(rate, 1),
                eta_s=round((tokens_left - totals["tokens"]) / rate, 1) if rate > 0 else None,
            )

        if not pending:
            return {}
        backend = make_backend(cfg, prepare_target(cfg), spec)
        waits = WriteStats()
        try:
            jobs = ((shard_path(fdir, s.index), load_shard_samples(tokenized, s)) for s in pending)
            capture_and_write(backend, spec, jobs, written, WriteOptions.from_config(cfg.capture), waits)
        finally:
            backend.close()
    elapsed_s = time.perf_counter() - start
    return {
        "num_shards": len(pending),
        "num_tokens": totals["tokens"],
        "elapsed_s": round(elapsed_s, 3),
        "tokens_per_s": round(totals["tokens"] / max(elapsed_s, 1e-9), 1),
        "writer_wait_s": round(waits.wait_s, 3),
        "peak_queued_bytes": waits.peak_queued_bytes,
    }


def run_capture(
    cfg: RunConfig, progress: ProgressFn | None = None, force: bool = False, known_key: str | None = None
) -> StageOutcome:
    """Prepare, capture every missing shard, finalize; a no-op when the manifest matches and shards are intact
    (``force``: check every shard and write the manifest again; a shard whose done file matches is kept)."""
    from eagle3.target.load import prepare_target

    manifest = features_dir(cfg) / MANIFEST_FILE
    spec = build_spec(cfg, prepare_target(cfg))
    key = known_key or capture_key(cfg, spec)
    skipped = None if force else skipped_outcome(STAGE, manifest, key, complete=lambda: _shards_intact(cfg))
    if skipped is not None:
        return skipped
    plan = prepare_capture(cfg, spec)
    manifest.unlink(missing_ok=True)  # only now: a refused prepare must not cost a valid manifest
    last_run = _capture_all(cfg, plan, spec, progress)  # prepare_capture saved exactly this spec
    return finalize_outcome(cfg, last_run, key)


def main(argv: list[str] | None = None) -> None:
    """python -m eagle3.features.capture --preset NAME [--set k=v ...] [--force]: capture every missing shard
    (nothing when the run trains online)."""
    from eagle3.run.cli_args import add_config_args, stage_main

    def run_cli(cfg: RunConfig, args: argparse.Namespace) -> StageOutcome | dict[str, str]:
        return {STAGE.name: ONLINE_SKIP} if cfg.train.features == "online" else run_capture(cfg, force=args.force)

    parser = add_config_args(argparse.ArgumentParser(description=main.__doc__))
    parser.add_argument("--force", action="store_true", help="check every shard and write the manifest again")
    stage_main(parser, argv, run_cli, lock_owner="python -m eagle3.features.capture", write_config=True)


if __name__ == "__main__":
    main()
