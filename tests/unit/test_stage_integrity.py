"""Completeness by content on the real data stages (tiny preset): flipped bytes, consumed inputs, killed writers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from eagle3.config import RunConfig, load_config
from eagle3.run.stage import CorruptOutputError, manifest_matches, run_stage
from eagle3.run.stages import data_dir, is_complete, run_all, run_merge, run_tokenize, run_vocab
from infra.storage import forget_hashes, sha256_file, temp_path_for


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """The tiny preset's data stages, run once; tests work on copies."""
    root = tmp_path_factory.mktemp("integrity")
    run_all(_config(root))
    return root


def _config(root: Path) -> RunConfig:
    return load_config("tiny", [f"run.workdir={root / 'runs'}", f"target.cache_dir={root / '_targets'}"])


@pytest.fixture
def cfg(tiny_run, tmp_path) -> RunConfig:
    shutil.copytree(tiny_run, tmp_path, dirs_exist_ok=True)
    forget_hashes()  # a fresh process would not know these files either
    return _config(tmp_path)


def _flip(path: Path, offset: int) -> None:
    """Flip one byte in place: same size, different content."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x01]))


def test_flipped_byte_in_a_completed_output_makes_its_stage_run_again(cfg):
    """One flipped byte (same size) in merged.parquet: merge is incomplete and its rerun restores the bytes."""
    merged = data_dir(cfg) / "merged.parquet"
    before = sha256_file(merged)
    _flip(merged, merged.stat().st_size // 2)
    assert not is_complete(cfg, "merge")
    outcome = run_merge(cfg)
    assert outcome.computed and sha256_file(merged) == before
    assert is_complete(cfg, "merge") and is_complete(cfg, "tokenize")


def test_consumed_input_that_changed_stops_the_next_stage_naming_the_file(cfg):
    """tokenized.parquet flipped after tokenize completed: vocab stops with an error naming it, runs nothing."""
    tokenized = data_dir(cfg) / "tokenized.parquet"
    _flip(tokenized, 100)
    vocab_manifest = cfg.run_dir / "vocab" / "vocab.manifest.json"
    before = vocab_manifest.read_bytes()
    with pytest.raises(CorruptOutputError, match=r"tokenized\.parquet has sha256 .* run stage tokenize again"):
        run_vocab(cfg, force=True)
    assert vocab_manifest.read_bytes() == before
    assert not is_complete(cfg, "tokenize")
    run_tokenize(cfg)
    assert is_complete(cfg, "vocab")


def test_killed_writers_temp_files_are_removed_by_the_next_run_of_their_stage(cfg):
    """Temp files a killed merge and tokenize left (named as atomic writes name them) go; others' files stay."""
    data = data_dir(cfg)
    leftovers = [
        temp_path_for(data / "merged.parquet"),
        temp_path_for(data / "rejects.jsonl"),
        temp_path_for(data / "tokenized.parquet"),
        temp_path_for(data / "tokenize.manifest.json"),
    ]
    for path in leftovers:
        path.write_bytes(b"x" * 1000)
    foreign = [data / ".notes.parquet.abc123.tmp", data / "merged.parquet.bak"]
    for path in foreign:
        path.write_bytes(b"keep")
    run_merge(cfg, force=True)
    assert [p.exists() for p in leftovers] == [False, False, True, True]  # merge removes only its own
    run_tokenize(cfg, force=True)
    assert not any(p.exists() for p in leftovers) and all(p.exists() for p in foreign)


def test_first_run_killed_before_any_manifest_still_cleans_up(tmp_path):
    """With no manifest to name the outputs, the run that completes removes the temp files of its outputs."""
    out = tmp_path / "out.bin"
    leftover = temp_path_for(out)

    def compute():
        out.write_bytes(b"rows")
        return {"out": out}, {}

    run_stage("merge", tmp_path / "merge.manifest.json", "k", compute)
    assert not leftover.exists() and manifest_matches(tmp_path / "merge.manifest.json", "k")
