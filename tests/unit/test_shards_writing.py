"""The capture plan, the disk preflight, the streaming shard writer and the writer pool: exact sizes,
golden bytes, byte-identical shards for any number of writers, failures and backpressure."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import shutil
import struct
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eagle3.data.tokenize import TOKENIZED_SCHEMA
from eagle3.features.plan import CapturePlan, build_plan, check_disk, plan_shards, preflight_bytes
from eagle3.features.shards import writer
from eagle3.features.shards.check import ShardValidationError
from eagle3.features.shards.layout import done_path_for, shard_file_bytes, shard_path
from eagle3.features.shards.reader import ShardReader
from eagle3.features.shards.writer import ShardStream, ShardWriteError, write_shard
from eagle3.features.spec import CapturedSample, FeatureSpec, SampleTokens
from eagle3.features.writers import WriteOptions, WriteStats, capture_and_write
from infra.storage import DiskSpaceError
from tests.unit.shard_samples import (
    VOCAB,
    H,
    K,
    make_features_dir,
    make_samples,
    make_spec,
    patterned_samples,
    request_of,
)

# ---- plan ---------------------------------------------------------------------------------------------


def test_plan_is_greedy_balanced_and_keeps_order():
    """Shards keep row order and budget, close only when the next sample would overflow; long samples sit alone."""
    lengths = [30, 40, 20, 150, 10, 10, 90, 5, 60]
    ids = [f"r{i}" for i in range(len(lengths))]
    shards = plan_shards(ids, lengths, 100)
    assert [i for s in shards for i in s.sample_ids] == ids
    assert [s.sample_ids for s in shards] == [["r0", "r1", "r2"], ["r3"], ["r4", "r5"], ["r6", "r7"], ["r8"]]
    for shard, nxt in zip(shards, shards[1:]):
        assert shard.num_tokens <= 100 or len(shard.sample_ids) == 1
        assert shard.num_tokens + lengths[nxt.row_start] > 100
        assert shard.row_end == nxt.row_start
    assert [s.index for s in shards] == list(range(len(shards)))


def _tokenized(path: Path, lengths: list[int]) -> Path:
    rows = [
        {
            "id": f"src:{i}",
            "split": "val" if i % 4 == 0 else "train",
            "input_ids": [1] * n,
            "loss_mask": [1] * n,
            "num_tokens": n,
            "num_loss_tokens": n,
            "truncated": False,
        }
        for i, n in enumerate(lengths)
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=TOKENIZED_SCHEMA), path)
    return path


def test_replan_is_identical_and_covers_both_splits(tmp_path):
    """Planning the same tokenized file twice gives the same plan.json bytes, val rows included."""
    tokenized = _tokenized(tmp_path / "tokenized.parquet", [7, 3, 12, 5, 9, 1, 4])
    first = build_plan(tokenized, 12, "key1")
    first.save(tmp_path / "a.json")
    build_plan(tokenized, 12, "key1").save(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert first.num_samples == 7 and "src:0" in first.shards[0].sample_ids  # src:0 is a val row
    assert CapturePlan.load(tmp_path / "a.json") == first


def test_preflight_is_exact_for_the_shard_files(tmp_path):
    """Preflight bytes = tokens x bytes_per_token + headers, and each planned shard's file is exactly its estimate."""
    spec = make_spec("float8_e4m3fn")
    fdir = make_features_dir(tmp_path, spec)
    lengths = [4, 6, 3, 8, 2]
    plan = CapturePlan(plan_shards([f"s{i}" for i in range(5)], lengths, 10), "k", 10)
    need = preflight_bytes(plan, spec)
    samples = {s.id: s for s in make_samples(spec, lengths)}
    written = 0
    for shard in plan.shards:
        write_shard(shard_path(fdir, shard.index), spec, [samples[i] for i in shard.sample_ids])
        size = shard_path(fdir, shard.index).stat().st_size
        assert size == shard_file_bytes(spec, shard.sample_ids, shard.num_tokens)
        written += size + done_path_for(shard_path(fdir, shard.index)).stat().st_size
    payload = sum(lengths) * spec.bytes_per_token()
    assert written <= need and need - payload < len(plan.shards) * 4096


def test_check_disk_names_both_numbers(tmp_path, monkeypatch):
    """When the disk is too small the error names the bytes needed and the bytes free."""
    usage = shutil._ntuple_diskusage(10**9, 10**9 - 123_456, 123_456)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    with pytest.raises(DiskSpaceError) as err:
        check_disk(tmp_path, 5_000_000, 1_000)
    assert "5,000,000" in str(err.value) and "123,456" in str(err.value)
    assert check_disk(tmp_path, 100_000, 1_000) == 123_456


# ---- streaming writer -----------------------------------------------------------------------------

# sha256 of the tensor payload (the file after its JSON header) that the whole-list writer of format
# version 1 produced for patterned_samples(spec, [5, 1, 9]); the streaming writer must match it.
PAYLOAD_SHA256 = {
    ("bfloat16", "final_hidden"): "bf827f13935b31e29a5d15bbfe15d5fab2da6eac7db75c501e76259cf9d5efc0",
    ("float8_e4m3fn", "final_hidden"): "e47c0f10486c45d751e87e0b9dbb04022656562e4fbfba770e18d66b1baa4650",
    ("bfloat16", "topk_logprobs"): "ea7cbc02c31df64b572fc6f6483996d0a445951c543a14ec9e2a30cbccd21e1d",
}


@pytest.mark.parametrize("aux_dtype,supervision", list(PAYLOAD_SHA256))
def test_streamed_shard_matches_golden_payload(tmp_path, monkeypatch, aux_dtype, supervision):
    """Samples streamed one at a time (later regions held for file order, early writeback and a hash
    backlog bound hit on every piece) give the golden payload, a done file whose sha256 and size are the
    file's, and the same bytes and done document as write_shard."""
    monkeypatch.setattr(writer, "WRITEBACK_BYTES", 1)
    monkeypatch.setattr(writer, "HASH_BACKLOG_BYTES", 1)
    spec = make_spec(aux_dtype, supervision)
    samples = patterned_samples(spec, [5, 1, 9])
    stream = ShardStream(shard_path(tmp_path, 0), spec, request_of(samples))
    for sample in samples:
        stream.append([sample])
    stream.seal()
    doc = stream.commit()
    data = shard_path(tmp_path, 0).read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    assert hashlib.sha256(data[8 + header_len :]).hexdigest() == PAYLOAD_SHA256[(aux_dtype, supervision)]
    assert doc.sha256 == hashlib.sha256(data).hexdigest() and doc.num_bytes == len(data)
    whole = write_shard(shard_path(tmp_path, 1), spec, samples, request_of(samples))
    assert shard_path(tmp_path, 1).read_bytes() == data and dataclasses.replace(whole, file=doc.file) == doc


def test_stream_refuses_unrequested_or_missing_samples_and_abort_cleans_up(tmp_path):
    """A sample other than the next requested one, or sealing before all arrived, raises naming the sample;
    abort leaves neither the shard, nor a done file, nor a temp file."""
    spec = make_spec()
    fdir = make_features_dir(tmp_path, spec)
    samples = make_samples(spec, [3, 4, 2])
    stream = ShardStream(shard_path(fdir, 0), spec, request_of(samples))
    with pytest.raises(ShardValidationError, match="out of order or wrong") as err:
        stream.append([samples[1]])
    assert err.value.sample_id == "s1"
    stream.append(samples[:2])
    with pytest.raises(ShardValidationError, match="2 of 3 requested samples") as err:
        stream.seal()
    assert err.value.sample_id == "s2"
    stream.abort()
    assert sorted(p.name for p in fdir.iterdir()) == ["spec.json"]


# ---- the writer pool (capture_and_write) --------------------------------------------------------------


class FakeCaptureBackend:
    """Fake backend (no model): states are fixed functions of each sample's tokens; ``poison`` ids get a NaN."""

    def __init__(self, spec: FeatureSpec, poison: tuple[str, ...] = ()):
        self.spec, self.poison = spec, set(poison)
        self.num_bytes_out = 0

    def capture(self, samples):
        for req in samples:
            ids = torch.tensor(req.input_ids)
            n = len(ids)
            sample = CapturedSample(
                id=req.id,
                input_ids=ids,
                loss_mask=torch.tensor(req.loss_mask, dtype=torch.uint8),
                aux=(ids[:, None] * torch.arange(1, 3 * H + 1) % 31 - 15).float() / 4,
            )
            if self.spec.supervision == "final_hidden":
                sample.final = (ids[:, None] * torch.arange(1, H + 1) % 29 - 14).float() / 8
            else:
                sample.topk_ids = (ids[:, None] + torch.arange(K)) % VOCAB
                sample.topk_logprobs = -(ids[:, None] + torch.arange(K)).float() / VOCAB
            if req.id in self.poison:
                sample.aux[n - 1, 0] = float("nan")
            self.num_bytes_out += sum(
                t.nbytes for t in (sample.aux, sample.final, sample.topk_ids, sample.topk_logprobs) if t is not None
            )
            yield sample

    def close(self) -> None:
        pass


def _requests(num_shards: int, lengths: list[int]) -> list[list[SampleTokens]]:
    return [
        [
            SampleTokens(f"j{j}-s{i}", [(7 * j + 3 * i + t) % VOCAB for t in range(n)], [t % 2 for t in range(n)])
            for i, n in enumerate(lengths)
        ]
        for j in range(num_shards)
    ]


def _jobs(fdir: Path, requests: list[list[SampleTokens]]) -> list[tuple[Path, list[SampleTokens]]]:
    return [(shard_path(fdir, j), samples) for j, samples in enumerate(requests)]


@pytest.mark.parametrize("aux_dtype,supervision", [("bfloat16", "final_hidden"), ("float8_e4m3fn", "topk_logprobs")])
def test_writer_pool_gives_identical_shards_for_any_number_of_writers(tmp_path, aux_dtype, supervision):
    """Whole shards with one writer (the previous scheme), and streaming with 1 or 3 writers and a queue of
    a few samples, give byte-identical shard and done files, every one complete and verified."""
    spec = make_spec(aux_dtype, supervision)
    requests = _requests(5, [6, 2, 9, 4])
    variants = {
        "whole-1": WriteOptions(stream=False, num_writers=1),
        "stream-1": WriteOptions(num_writers=1),
        "stream-3-small-queue": WriteOptions(num_writers=3, queue_bytes=3 * 9 * 4 * H * 4),
    }
    files = {}
    for name, options in variants.items():
        fdir = make_features_dir(tmp_path / name, spec)
        docs = capture_and_write(FakeCaptureBackend(spec), spec, _jobs(fdir, requests), options=options)
        assert [d.file for d in docs] == [shard_path(fdir, j).name for j in range(5)]
        assert sorted(ShardReader(fdir).shards) == list(range(5)) and all(ShardReader(fdir).verify(j) for j in range(5))
        files[name] = {p.name: p.read_bytes() for p in sorted(fdir.glob("shard-*"))}
    assert len(files["whole-1"]) == 10
    assert files["whole-1"] == files["stream-1"] == files["stream-3-small-queue"]


def _fail_seal_of(monkeypatch, name: str) -> None:
    original = ShardStream.seal

    def seal(self) -> None:
        if self.path.name == name:
            raise OSError(errno.ENOSPC, "simulated full disk")
        original(self)

    monkeypatch.setattr(ShardStream, "seal", seal)


@pytest.mark.parametrize("failure", ["nan_sample", "disk_full"])
@pytest.mark.parametrize(
    "options",
    [WriteOptions(stream=False, num_writers=1), WriteOptions(num_writers=1), WriteOptions(num_writers=3)],
    ids=["whole-1", "stream-1", "stream-3"],
)
def test_failed_writer_names_its_shard_and_no_later_shard_is_complete(tmp_path, monkeypatch, options, failure):
    """A bad sample or a disk error in shard 1 raises ShardWriteError naming shard-00001 (and the sample);
    shard 0 is complete, no later shard has a done file, and no temp file is left behind."""
    spec = make_spec()
    fdir = make_features_dir(tmp_path, spec)
    requests = _requests(4, [5, 3, 7])
    poison = ("j1-s2",) if failure == "nan_sample" else ()
    if failure == "disk_full":
        _fail_seal_of(monkeypatch, "shard-00001.safetensors")
    with pytest.raises(ShardWriteError, match="shard-00001") as err:
        capture_and_write(FakeCaptureBackend(spec, poison), spec, _jobs(fdir, requests), options=options)
    assert err.value.shard == "shard-00001"
    assert ("'j1-s2'" in str(err.value)) if failure == "nan_sample" else ("simulated full disk" in str(err.value))
    assert sorted(p.name for p in fdir.glob("shard-*.done.json")) == ["shard-00000.done.json"]
    assert not list(fdir.glob(".*.tmp")) and not shard_path(fdir, 1).exists()
    assert list(ShardReader(fdir).shards) == [0] and ShardReader(fdir).verify(0)


def test_backpressure_bounds_bytes_captured_but_not_written(tmp_path, monkeypatch):
    """With a writer held until the capture loop waits, the backend is never more than write_queue_bytes ahead
    of what is written, the capture loop does wait, and every shard still completes."""
    spec = make_spec()
    fdir = make_features_dir(tmp_path, spec)
    sample_bytes = 8 * (3 * H + H) * 4  # 8 tokens of fp32 aux + final, as the fake backend hands them out
    limit = 4 * sample_bytes
    written, lock, ahead = [0], threading.Lock(), []
    original = ShardStream.append

    def slow_append(self, samples, validated=False):
        samples = list(samples)
        deadline = time.monotonic() + 10  # the writer waits until the capture loop had to wait (not a timing race)
        while stats.num_waits == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        original(self, samples, validated)
        with lock:
            written[0] += sum(s.aux.nbytes + s.final.nbytes for s in samples)

    monkeypatch.setattr(ShardStream, "append", slow_append)
    backend = FakeCaptureBackend(spec)
    requests = _requests(3, [8] * 10)
    capture = backend.capture

    def watched(samples):
        for sample in capture(samples):
            with lock:
                ahead.append(backend.num_bytes_out - sample_bytes - written[0])  # handed out before this one
            yield sample

    backend.capture = watched
    stats = WriteStats()
    docs = capture_and_write(
        backend, spec, _jobs(fdir, requests), options=WriteOptions(num_writers=2, queue_bytes=limit), stats=stats
    )
    assert len(docs) == 3 and sorted(ShardReader(fdir).shards) == [0, 1, 2]
    assert max(ahead) <= limit and max(ahead) >= limit - sample_bytes
    assert stats.num_waits > 0 and stats.peak_queued_bytes <= limit
