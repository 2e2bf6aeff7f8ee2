"""Capture under crashes: SIGKILL mid-run, kills inside a shard write; resume gives byte-identical shards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3.config import RunConfig
from eagle3.features.capture import features_dir, run_capture
from eagle3.features.shards import writer
from eagle3.features.shards.reader import ShardReader
from eagle3.features.shards.writer import ShardWriteError
from infra.storage import sha256_file
from tests.unit.test_hf_capture import tiny_base, tiny_run  # noqa: F401  (module fixture + helper)

TOKENS_PER_SHARD = "capture.tokens_per_shard=400"  # ~18 shards of the 7k-token tiny set
REPO = Path(__file__).resolve().parents[2]

# Runs the capture CLI with a pause after each shard is committed, so an outside SIGKILL lands mid-run.
SLOW_DRIVER = """
import sys, time
import eagle3.features.capture as capture
from eagle3.features.shards.writer import ShardStream
original = ShardStream.commit
def slow(self):
    result = original(self)
    time.sleep(0.3)
    return result
ShardStream.commit = slow
capture.main(sys.argv[1:])
"""

# Runs the capture CLI and SIGKILLs itself when the third shard file is fully written but not yet renamed.
KILL_BEFORE_RENAME_DRIVER = """
import os, signal, sys
import infra.storage as storage
import eagle3.features.capture as capture
original = storage.commit_temp
calls = []
def commit(tmp, path):
    calls.append(path)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return original(tmp, path)
storage.commit_temp = commit
capture.main(sys.argv[1:])
"""


def _cli_args(cfg: RunConfig, base: Path) -> list[str]:
    return [
        "--preset",
        "tiny",
        "--set",
        f"run.workdir={cfg.run.workdir}",
        "--set",
        f"target.cache_dir={base / '_targets'}",
        "--set",
        TOKENS_PER_SHARD,
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}


def _hashes(fdir: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(fdir.glob("shard-*.safetensors"))}


def _tokenized_ids(cfg: RunConfig) -> list[str]:
    return pq.read_table(cfg.run_dir / "data" / "tokenized.parquet", columns=["id"])["id"].to_pylist()


def _done_ids(fdir: Path) -> list[str]:
    return [i for p in sorted(fdir.glob("shard-*.done.json")) for i in json.loads(p.read_text())["sample_ids"]]


@pytest.fixture(scope="module")
def reference(tiny_base, tmp_path_factory) -> dict[str, str]:  # noqa: F811
    """Shard hashes of an uninterrupted capture in its own directory."""
    cfg = tiny_run(tiny_base, tmp_path_factory.mktemp("reference"), TOKENS_PER_SHARD)
    run_capture(cfg)
    hashes = _hashes(features_dir(cfg))
    assert len(hashes) > 10
    return hashes


def _assert_complete_and_identical(cfg: RunConfig, reference: dict[str, str]) -> None:
    fdir = features_dir(cfg)
    reader = ShardReader(fdir)  # raises if any id is in two complete shards
    assert reader.ids() == _tokenized_ids(cfg) and len(set(reader.ids())) == len(reader)
    assert not list(fdir.glob(".*.tmp"))
    assert _hashes(fdir) == reference
    assert all(reader.verify(i) for i in reader.shards)


def test_sigkill_mid_run_then_resume_is_byte_identical(tiny_base, reference, tmp_path):  # noqa: F811
    """SIGKILL after the first shards: readers see only complete shards; the resumed run matches a clean run."""
    cfg = tiny_run(tiny_base, tmp_path, TOKENS_PER_SHARD)
    fdir = features_dir(cfg)
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_DRIVER, *_cli_args(cfg, tiny_base)],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while len(list(fdir.glob("shard-*.done.json"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stderr.close()
    done_ids = _done_ids(fdir)
    assert 0 < len(done_ids) < len(_tokenized_ids(cfg)) and not (fdir / "capture.manifest.json").exists()
    assert ShardReader(fdir).ids() == done_ids
    assert run_capture(cfg).computed
    _assert_complete_and_identical(cfg, reference)


def test_kill_inside_a_shard_write_leaves_an_ignored_temp_file(tiny_base, reference, tmp_path):  # noqa: F811
    """Killed between writing a shard and renaming it: the temp file is not counted and is cleaned on resume."""
    cfg = tiny_run(tiny_base, tmp_path, TOKENS_PER_SHARD)
    fdir = features_dir(cfg)
    proc = subprocess.run(
        [sys.executable, "-c", KILL_BEFORE_RENAME_DRIVER, *_cli_args(cfg, tiny_base)],
        env=_env(),
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    temps = list(fdir.glob(".shard-00002.safetensors.*.tmp"))
    assert len(temps) == 1 and temps[0].stat().st_size > 0
    assert ShardReader(fdir).ids() == _done_ids(fdir) and sorted(ShardReader(fdir).shards) == [0, 1]
    run_capture(cfg)
    _assert_complete_and_identical(cfg, reference)


def test_crash_before_done_file_is_recaptured(tiny_base, reference, tmp_path, monkeypatch):  # noqa: F811
    """A shard file without its done file (crash right after the rename) is invisible and rewritten identically."""
    cfg = tiny_run(tiny_base, tmp_path, TOKENS_PER_SHARD)
    original, calls = writer.atomic_write_json, []

    def crash_on_third(path, obj):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("simulated crash before the done file")
        return original(path, obj)

    monkeypatch.setattr(writer, "atomic_write_json", crash_on_third)
    with pytest.raises(ShardWriteError, match="shard-00002: OSError: simulated crash") as err:
        run_capture(cfg)
    assert isinstance(err.value.__cause__, OSError)
    fdir = features_dir(cfg)
    assert (fdir / "shard-00002.safetensors").is_file() and sorted(ShardReader(fdir).shards) == [0, 1]
    monkeypatch.setattr(writer, "atomic_write_json", original)
    run_capture(cfg)
    _assert_complete_and_identical(cfg, reference)


def test_cli_twice_second_run_skips_everything(tiny_base, reference, tmp_path):  # noqa: F811
    """`python -m eagle3.features.capture --preset tiny` twice: the second computes nothing and touches no shard."""
    cfg = tiny_run(tiny_base, tmp_path, TOKENS_PER_SHARD)
    args = [sys.executable, "-m", "eagle3.features.capture", *_cli_args(cfg, tiny_base)]
    first = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert json.loads(first.stdout)["computed"]
    fdir = features_dir(cfg)
    stamps = {p.name: p.stat().st_mtime_ns for p in fdir.iterdir()}
    second = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert not json.loads(second.stdout)["computed"]
    assert {p.name: p.stat().st_mtime_ns for p in fdir.iterdir()} == stamps
    _assert_complete_and_identical(cfg, reference)
