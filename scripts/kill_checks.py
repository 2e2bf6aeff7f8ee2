"""The end-of-trial checks of scripts/kill_harness.py: what a run killed many times must still satisfy.

Each check returns a ``Check`` (name, passed, detail). They read the run directory with their own
fresh sha256 (never a cache) and compare it with an uninterrupted reference run of the same config.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3.data.stages import regenerate, tokenize
from eagle3.evaluate import stage as evaluate
from eagle3.export import stage as export
from eagle3.features.shards.done import ShardDone
from eagle3.features.shards.layout import done_path_for, shard_path
from eagle3.run.registry import STAGES
from eagle3.run.stage import read_manifest
from eagle3.train import STAGE as TRAIN
from infra.locks import LOCK_FILE, read_holder
from infra.storage import sha256_file

TEMP_NAME_RE = re.compile(r"^\..+(\.tmp$|\.tmp-\d+$|\.old-\d+$)")
"""Leftovers of a killed writer: atomic_open/temp_path_for files, checkpoint temp dirs, publish_dir's moved-aside
dirs."""


@dataclass(frozen=True)
class Check:
    """One verified property of a trial's run directory."""

    name: str
    passed: bool
    detail: str

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict."""
        return asdict(self)


def manifests(run_dir: Path) -> list[Path]:
    """Every stage manifest of a run (data, vocab, features, train, export, eval)."""
    return sorted(Path(run_dir).glob("*/*.manifest.json"))


def check_manifests(run_dir: Path, expected: int) -> Check:
    """Every manifest names outputs that exist with the recorded size and (freshly computed) sha256."""
    problems, found = [], manifests(run_dir)
    for manifest in found:
        doc = read_manifest(manifest) or {}
        for name, entry in doc.get("outputs", {}).items():
            path = manifest.parent / entry["path"]
            if not path.is_file() or path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
                problems.append(f"{manifest.name}:{name}")
    if len(found) != expected:
        problems.append(f"{len(found)} manifests, expected {expected}")
    return Check(
        "manifests_match_outputs",
        not problems,
        f"{len(found)} manifests, every output's size and sha256 as recorded"
        if not problems
        else "mismatch: " + ", ".join(problems),
    )


def _shard_header_ids(path: Path) -> list[str]:
    """The sample ids a shard's own safetensors header records."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        return json.loads(fh.metadata()["sample_ids"])


def check_shards(run_dir: Path) -> Check:
    """No lost, duplicated, extra or corrupt shard: each planned shard's sha256 matches its done file, its header
    names the done file's samples, and the sample ids over all shards are the plan's, each exactly once."""
    fdir = Path(run_dir) / "features"
    plan = json.loads((fdir / "plan.json").read_text())
    planned = {s["index"]: s["sample_ids"] for s in plan["shards"]}
    problems, ids = [], Counter()
    for index, plan_ids in planned.items():
        st, done = shard_path(fdir, index), done_path_for(shard_path(fdir, index))
        if not st.is_file() or not done.is_file():
            problems.append(f"shard {index} lost")
            continue
        doc = ShardDone.from_json(json.loads(done.read_text()))
        if sha256_file(st) != doc.sha256 or st.stat().st_size != doc.num_bytes:
            problems.append(f"shard {index} corrupt (sha256/size differ from its done file)")
        if doc.sample_ids != plan_ids or _shard_header_ids(st) != plan_ids:
            problems.append(f"shard {index} holds other samples than planned")
        ids.update(doc.sample_ids)
    extra = sorted(p.name for p in fdir.glob("shard-*") if int(p.name[6:11]) not in planned)
    plan_ids = Counter(i for s in plan["shards"] for i in s["sample_ids"])
    dupes = sorted(i for i, n in ids.items() if n > 1)
    if extra:
        problems.append(f"shards beyond the plan: {extra[:4]}")
    if dupes or set(ids) != set(plan_ids) or any(n > 1 for n in plan_ids.values()):
        problems.append(
            f"sample ids differ from the plan's ({len(dupes)} duplicated, {len(set(plan_ids) - set(ids))} missing)"
        )
    if plan["num_samples"] != sum(ids.values()):
        problems.append(f"{sum(ids.values())} samples in shards, plan says {plan['num_samples']}")
    return Check(
        "shards_complete_unique_uncorrupted",
        not problems,
        f"{len(planned)} shards, {sum(ids.values())} samples, each once, sha256 as in the done files"
        if not problems
        else "; ".join(problems),
    )


def _count_lines(path: Path) -> int:
    return sum(1 for line in path.read_text(encoding="utf-8").split("\n") if line.strip())


def _parquet_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def check_rejects(run_dir: Path) -> Check:
    """Every record is kept or rejected, and every reject is written down: merge read = kept + rejected (= rows +
    rejects.jsonl lines), regeneration input = answered + errors (+ skipped), tokenize in = written + rejected."""
    data, problems = Path(run_dir) / "data", []
    total = json.loads((data / "stats.json").read_text())["total"]
    merge = (
        total["read"],
        total["kept"] + total["rejected"],
        total["kept"] + _count_lines(data / "rejects.jsonl"),
        _parquet_rows(data / "merged.parquet") + total["rejected"],
    )
    if len(set(merge)) != 1:
        problems.append(f"merge read/kept+rejected/rows+rejects disagree: {merge}")
    regen = read_manifest(regenerate.STAGE.manifest(Path(run_dir)))["stats"]
    skipped = regen["skipped_done"] + regen["skipped_source"] + regen["skipped_limit"]
    regen_counts = (
        regen["input"],
        regen["success"] + regen["error"] + skipped,
        total["kept"],
        _parquet_rows(data / "regenerated.parquet") + _count_lines(data / "regenerate_errors.jsonl"),
    )
    if len(set(regen_counts)) != 1:
        problems.append(f"regenerate input/success+error/merged rows/parquet+errors disagree: {regen_counts}")
    tok = read_manifest(tokenize.STAGE.manifest(Path(run_dir)))["stats"]
    tok_counts = (
        tok["rows_in"],
        tok["rows_written"] + tok["rows_rejected"],
        _parquet_rows(data / "tokenized.parquet") + _count_lines(data / "tokenize_rejects.jsonl"),
    )
    if len(set(tok_counts)) != 1:
        problems.append(f"tokenize in/written+rejected/rows+reject lines disagree: {tok_counts}")
    return Check(
        "rejects_accounted_for",
        not problems,
        f"merge read {total['read']} = kept {total['kept']} + rejected {total['rejected']}; regenerate "
        f"{regen['input']} = {regen['success']} answered + {regen['error']} errors + {skipped} skipped; "
        f"tokenize {tok['rows_in']} = {tok['rows_written']} + {tok['rows_rejected']} rejected"
        if not problems
        else "; ".join(problems),
    )


def _output_hashes(manifest: Path) -> dict[str, str]:
    doc = read_manifest(manifest) or {}
    return {name: entry["sha256"] for name, entry in doc.get("outputs", {}).items()}


def check_same_data(run_dir: Path, ref_dir: Path) -> Check:
    """The outputs of every reproducible stage (eagle3.run.registry: data, vocab, capture) that the uninterrupted run
    ran are byte-identical to its."""
    ran = [s for s in STAGES if s.reproducible and s.manifest(ref_dir).is_file()]
    differ = [
        s.name
        for s in ran
        if not _output_hashes(s.manifest(run_dir))
        or _output_hashes(s.manifest(run_dir)) != _output_hashes(s.manifest(ref_dir))
    ]
    return Check(
        "data_and_shards_equal_uninterrupted_run",
        bool(ran) and not differ,
        f"{len(ran)} stages' outputs have the reference run's sha256"
        if not differ
        else f"outputs differ from the reference run in {differ}",
    )


def _final_checkpoint(run_dir: Path) -> Path:
    doc = read_manifest(TRAIN.manifest(Path(run_dir)))
    return TRAIN.manifest(Path(run_dir)).parent / doc["outputs"]["model"]["path"]


def check_same_drafter(run_dir: Path, ref_dir: Path) -> Check:
    """The final (and the exported) drafter equals the uninterrupted run's, tensor for tensor, bit for bit."""
    from safetensors.torch import load_file

    mine, ref = load_file(str(_final_checkpoint(run_dir))), load_file(str(_final_checkpoint(ref_dir)))
    differ = sorted(
        k
        for k in set(mine) | set(ref)
        if k not in mine or k not in ref or mine[k].dtype != ref[k].dtype or not mine[k].equal(ref[k])
    )
    exported = {k: v for k, v in _output_hashes(export.STAGE.manifest(run_dir)).items() if "weights" in k}
    if (
        exported != {k: v for k, v in _output_hashes(export.STAGE.manifest(ref_dir)).items() if "weights" in k}
        or not exported
    ):
        differ.append("exported weights")
    return Check(
        "drafter_equals_uninterrupted_run",
        not differ,
        f"final checkpoint {_final_checkpoint(run_dir).parent.name}: {len(mine)} tensors bitwise equal; "
        f"exported weights' sha256 equal"
        if not differ
        else f"differ: {differ[:6]}",
    )


def check_same_eval(run_dir: Path, ref_dir: Path) -> Check:
    """Evaluation measured the same acceptance lengths and lossless counts as the uninterrupted run."""

    def figures(path: Path) -> dict[str, Any]:
        stats = (read_manifest(evaluate.STAGE.manifest(Path(path))) or {}).get("stats", {})
        return {k: (v.get("accept_len"), v.get("lossless_identical")) for k, v in stats.items()}

    mine, ref = figures(run_dir), figures(ref_dir)
    return Check(
        "evaluation_equals_uninterrupted_run",
        bool(mine) and mine == ref,
        f"accept_len and lossless counts of {sorted(mine)} equal"
        if mine == ref and mine
        else f"{mine} vs reference {ref}",
    )


def stray_temps(workdir: Path) -> list[str]:
    """Temp files and folders a killed writer left anywhere under the work directory."""
    found = []
    for root, dirs, files in os.walk(workdir):
        for name in [*dirs, *files]:
            if TEMP_NAME_RE.match(name):
                found.append(os.path.relpath(os.path.join(root, name), workdir))
    return sorted(found)


def check_no_temps(workdir: Path) -> Check:
    """No temp file or folder of a killed writer is left once every stage has run again."""
    found = stray_temps(workdir)
    return Check("no_stray_temp_files", not found, "none" if not found else f"{len(found)} left: {found[:6]}")


def check_lock_free(run_dir: Path) -> Check:
    """The run lock is free and its holder record empty: a SIGKILLed holder left no stale lock behind."""
    from infra.locks import LockHeldError, run_lock

    holder = read_holder(Path(run_dir) / LOCK_FILE)
    try:
        with run_lock(run_dir, owner="kill harness check"):
            free = True
    except LockHeldError:
        free = False
    return Check(
        "run_lock_free",
        free and not holder,
        "lock taken at once, holder record empty" if free and not holder else f"free={free}, holder={holder}",
    )


def all_checks(run_dir: Path, ref_dir: Path, workdir: Path) -> list[Check]:
    """Every end-of-trial check, in a fixed order."""
    return [
        check_shards(run_dir),
        check_manifests(run_dir, len(manifests(ref_dir))),
        check_rejects(run_dir),
        check_same_data(run_dir, ref_dir),
        check_same_drafter(run_dir, ref_dir),
        check_same_eval(run_dir, ref_dir),
        check_no_temps(workdir),
        check_lock_free(run_dir),
    ]
