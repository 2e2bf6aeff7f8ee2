"""Shard files, fp8 storage, the capture plan and the shard writer pool: round trips, validation,
completeness, exact sizes, golden bytes, failures and backpressure."""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import struct
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3.data.tokenize import TOKENIZED_SCHEMA
from eagle3.features.fp8 import FP8_MAX, dequantize_fp8, fp8_error, quantize_fp8
from eagle3.features import shards
from eagle3.features.plan import CapturePlan, build_plan, check_disk, plan_shards, preflight_bytes
from eagle3.features.shards import (
    ShardReader,
    ShardStream,
    ShardValidationError,
    ShardWriteError,
    done_path_for,
    shard_file_bytes,
    shard_path,
    spec_hash,
    write_shard,
)
from eagle3.features.spec import CapturedSample, FeatureSpec, SampleTokens
from eagle3.features.writers import WriteOptions, WriteStats, capture_and_write
from infra.storage import DiskSpaceError, sha256_file

H, VOCAB, K = 8, 50, 4


def make_spec(aux_dtype: str = "bfloat16", supervision: str = "final_hidden", dtype: str = "bfloat16") -> FeatureSpec:
    """A small spec: H=8, three aux layers, vocab 50."""
    return FeatureSpec(target_name="t", target_fingerprint="fp", hidden_size=H, num_layers=6, vocab_size=VOCAB,
                       aux_layer_ids=[1, 2, 3], supervision=supervision,
                       topk=K if supervision == "topk_logprobs" else None,
                       dtype=dtype, aux_dtype=aux_dtype, max_len=64, chat_template_hash="tmpl", backend="hf")


def make_samples(spec: FeatureSpec, lengths: list[int], seed: int = 0, prefix: str = "s") -> list[CapturedSample]:
    """Random fp32 samples of the given lengths (ids and shapes consistent with ``spec``)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        sample = CapturedSample(id=f"{prefix}{i}", input_ids=torch.randint(0, VOCAB, (n,), generator=gen),
                                loss_mask=torch.randint(0, 2, (n,), generator=gen, dtype=torch.uint8),
                                aux=torch.randn(n, 3 * H, generator=gen) * 3)
        if spec.supervision == "final_hidden":
            sample.final = torch.randn(n, H, generator=gen)
        else:
            logits = torch.randn(n, VOCAB, generator=gen)
            sample.topk_logprobs, sample.topk_ids = torch.log_softmax(logits, -1).topk(K, -1)
        out.append(sample)
    return out


def _features(tmp_path: Path, spec: FeatureSpec) -> Path:
    fdir = tmp_path / "features"
    fdir.mkdir(parents=True, exist_ok=True)
    spec.save(fdir / "spec.json")
    return fdir


# ---- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("aux_dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
@pytest.mark.parametrize("supervision", ["final_hidden", "topk_logprobs"])
def test_round_trip_every_tensor(tmp_path, aux_dtype, supervision):
    """Every tensor reads back as written (cast to the spec dtypes; fp8 aux = its exact dequantization)."""
    spec = make_spec(aux_dtype, supervision)
    fdir = _features(tmp_path, spec)
    samples = make_samples(spec, [5, 1, 9])
    write_shard(shard_path(fdir, 0), spec, samples)
    reader = ShardReader(fdir)
    assert len(reader) == 3 and reader.ids() == ["s0", "s1", "s2"] and reader.num_tokens == 15
    for sample in samples:
        got = reader.get(sample.id)
        assert torch.equal(got["input_ids"], sample.input_ids.to(torch.int32))
        assert torch.equal(got["loss_mask"], sample.loss_mask)
        if aux_dtype == "float8_e4m3fn":
            assert got["aux"].dtype == torch.bfloat16
            assert torch.equal(got["aux"], dequantize_fp8(*quantize_fp8(sample.aux), torch.bfloat16))
        else:
            assert torch.equal(got["aux"], sample.aux.to(getattr(torch, aux_dtype)))
        if supervision == "final_hidden":
            assert torch.equal(got["final"], sample.final.to(torch.bfloat16)) and "topk_ids" not in got
        else:
            assert torch.equal(got["topk_ids"], sample.topk_ids.to(torch.int32))
            assert torch.equal(got["topk_logprobs"], sample.topk_logprobs) and "final" not in got


def test_file_is_standard_safetensors_with_metadata(tmp_path):
    """safetensors' own loader reads the file: concatenated tensors, offsets, and ids/spec hash in metadata."""
    spec = make_spec()
    fdir = _features(tmp_path, spec)
    samples = make_samples(spec, [3, 4])
    write_shard(shard_path(fdir, 0), spec, samples)
    tensors = load_file(shard_path(fdir, 0))
    assert tensors["offsets"].tolist() == [0, 3, 7]
    assert torch.equal(tensors["aux"], torch.cat([s.aux for s in samples]).to(torch.bfloat16))
    assert tensors["input_ids"].dtype == torch.int32 and tensors["loss_mask"].dtype == torch.uint8
    with safe_open(str(shard_path(fdir, 0)), framework="pt") as fh:
        meta = fh.metadata()
    assert json.loads(meta["sample_ids"]) == ["s0", "s1"] and meta["spec_hash"] == spec_hash(spec)


def test_done_file_records_ids_size_and_hash(tmp_path):
    """The done file lists ids in order, the exact byte size and the sha256; verify() rechecks the hash."""
    spec = make_spec()
    fdir = _features(tmp_path, spec)
    doc = write_shard(shard_path(fdir, 0), spec, make_samples(spec, [2, 6, 3]))
    on_disk = json.loads(done_path_for(shard_path(fdir, 0)).read_text())
    assert on_disk == doc and doc["sample_ids"] == ["s0", "s1", "s2"] and doc["num_tokens"] == 11
    assert doc["num_bytes"] == shard_path(fdir, 0).stat().st_size == shard_file_bytes(spec, doc["sample_ids"], 11)
    assert doc["sha256"] == sha256_file(shard_path(fdir, 0)) and doc["spec_hash"] == spec_hash(spec)
    reader = ShardReader(fdir)
    assert reader.verify(0)
    with open(shard_path(fdir, 0), "r+b") as fh:  # flip one payload byte, keep the size
        fh.seek(-1, 2)
        last = fh.read(1)
        fh.seek(-1, 2)
        fh.write(bytes([last[0] ^ 0xFF]))
    assert not reader.verify(0)


def test_same_samples_give_identical_bytes(tmp_path):
    """Writing the same samples twice gives byte-identical files (the resume guarantee rests on it)."""
    spec = make_spec("float8_e4m3fn")
    a, b = _features(tmp_path / "a", spec), _features(tmp_path / "b", spec)
    doc_a = write_shard(shard_path(a, 0), spec, make_samples(spec, [4, 7]))
    doc_b = write_shard(shard_path(b, 0), spec, make_samples(spec, [4, 7]))
    assert doc_a == doc_b and shard_path(a, 0).read_bytes() == shard_path(b, 0).read_bytes()


# ---- validation -------------------------------------------------------------------------------------


def _short_rows(s: CapturedSample) -> None:
    s.aux = s.aux[:-1]


def _nan(s: CapturedSample) -> None:
    s.aux[2, 5] = float("nan")


def _inf_final(s: CapturedSample) -> None:
    s.final[0, 0] = float("inf")


def _wide(s: CapturedSample) -> None:
    s.aux = torch.cat([s.aux, s.aux[:, :1]], dim=1)


def _no_final(s: CapturedSample) -> None:
    s.final = None


def _bad_token(s: CapturedSample) -> None:
    s.input_ids[0] = VOCAB


@pytest.mark.parametrize("corrupt,needle", [(_short_rows, "aux has shape"), (_nan, "non-finite"),
                                            (_inf_final, "final has 1 non-finite"), (_wide, "aux has shape"),
                                            (_no_final, "final is missing"), (_bad_token, "input_ids outside")])
def test_invalid_sample_is_rejected_by_id_and_nothing_written(tmp_path, corrupt, needle):
    """A bad sample raises an error naming its id and the problem; no shard, done or temp file appears."""
    spec = make_spec()
    fdir = _features(tmp_path, spec)
    samples = make_samples(spec, [4, 6, 5])
    corrupt(samples[1])
    with pytest.raises(ShardValidationError, match=needle) as err:
        write_shard(shard_path(fdir, 0), spec, samples)
    assert "'s1'" in str(err.value) and err.value.sample_id == "s1"
    assert sorted(p.name for p in fdir.iterdir()) == ["spec.json"]


def test_duplicate_id_is_rejected(tmp_path):
    """Two samples with one id in a shard are refused, naming the id; nothing is written."""
    spec = make_spec()
    fdir = _features(tmp_path, spec)
    samples = make_samples(spec, [3, 3])
    samples[1].id = "s0"
    with pytest.raises(ShardValidationError, match="duplicate") as err:
        write_shard(shard_path(fdir, 0), spec, samples)
    assert "'s0'" in str(err.value) and sorted(p.name for p in fdir.iterdir()) == ["spec.json"]


def test_request_echo_is_checked(tmp_path):
    """States returned for other tokens or in another order than requested are refused."""
    spec = make_spec()
    fdir = _features(tmp_path, spec)
    samples = make_samples(spec, [3, 4])
    requested = [SampleTokens(s.id, s.input_ids.tolist(), s.loss_mask.tolist()) for s in samples]
    with pytest.raises(ShardValidationError, match="out of order"):
        write_shard(shard_path(fdir, 0), spec, samples[::-1], requested=requested)
    requested[1].input_ids[0] = (requested[1].input_ids[0] + 1) % VOCAB
    with pytest.raises(ShardValidationError, match="input_ids differ") as err:
        write_shard(shard_path(fdir, 0), spec, samples, requested=requested)
    assert err.value.sample_id == "s1" and sorted(p.name for p in fdir.iterdir()) == ["spec.json"]


def test_fp16_overflow_is_rejected(tmp_path):
    """A value finite in fp32 but beyond fp16's range is caught after the cast, naming the sample."""
    spec = make_spec(aux_dtype="float16")
    fdir = _features(tmp_path, spec)
    samples = make_samples(spec, [3])
    samples[0].aux[1, 1] = 1e6
    with pytest.raises(ShardValidationError, match="non-finite") as err:
        write_shard(shard_path(fdir, 0), spec, samples)
    assert err.value.sample_id == "s0" and not shard_path(fdir, 0).exists()


# ---- completeness as readers see it ------------------------------------------------------------------


def test_reader_ignores_shard_without_done_file(tmp_path):
    """A safetensors file whose done file is missing does not exist for readers."""
    spec = make_spec()
    fdir = _features(tmp_path, spec)
    write_shard(shard_path(fdir, 0), spec, make_samples(spec, [3], prefix="a"))
    write_shard(shard_path(fdir, 1), spec, make_samples(spec, [4], prefix="b"))
    done_path_for(shard_path(fdir, 1)).unlink()
    reader = ShardReader(fdir)
    assert reader.ids() == ["a0"] and list(reader.shards) == [0]
    with pytest.raises(KeyError):
        reader.get("b0")


def test_reader_ignores_shard_whose_size_changed(tmp_path):
    """A shard whose file is longer or shorter than its done file says is not counted."""
    spec = make_spec()
    fdir = _features(tmp_path, spec)
    write_shard(shard_path(fdir, 0), spec, make_samples(spec, [3], prefix="a"))
    write_shard(shard_path(fdir, 1), spec, make_samples(spec, [4], prefix="b"))
    with open(shard_path(fdir, 1), "ab") as fh:
        fh.write(b"\0")
    assert ShardReader(fdir).ids() == ["a0"]


def test_reader_refuses_a_shard_with_a_flipped_byte_naming_it(tmp_path):
    """A complete shard whose bytes changed (same size) stops the reader at open with the file named."""
    spec = make_spec()
    fdir = _features(tmp_path, spec)
    write_shard(shard_path(fdir, 0), spec, make_samples(spec, [3], prefix="a"))
    write_shard(shard_path(fdir, 1), spec, make_samples(spec, [4], prefix="b"))
    path = shard_path(fdir, 1)
    with open(path, "r+b") as fh:  # a byte of the payload, well past the header
        fh.seek(path.stat().st_size - 20)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x40]))
    reader = ShardReader(fdir)
    assert reader.get("a0")["input_ids"].numel() == 3
    with pytest.raises(shards.CorruptShardError, match=r"shard-00001\.safetensors does not match the sha256"):
        reader.get("b0")


def test_reader_ignores_shards_of_another_spec_and_temp_files(tmp_path):
    """Shards recorded under another spec hash, and leftover temp files, are invisible."""
    spec = make_spec()
    fdir = _features(tmp_path, spec)
    write_shard(shard_path(fdir, 0), make_spec(dtype="float32"), make_samples(spec, [3]))
    (fdir / ".shard-00001.safetensors.abc.tmp").write_bytes(b"partial")
    assert len(ShardReader(fdir)) == 0


def test_rewrite_replaces_done_file(tmp_path):
    """Rewriting a shard index with other samples leaves a done file describing only the new bytes."""
    spec = make_spec()
    fdir = _features(tmp_path, spec)
    write_shard(shard_path(fdir, 0), spec, make_samples(spec, [3, 3], prefix="old"))
    doc = write_shard(shard_path(fdir, 0), spec, make_samples(spec, [5], prefix="new"))
    reader = ShardReader(fdir)
    assert reader.ids() == ["new0"] and doc["sha256"] == sha256_file(shard_path(fdir, 0)) and reader.verify(0)


# ---- fp8 ----------------------------------------------------------------------------------------------


def test_fp8_scale_and_error():
    """Scale = amax/448 per row, zero rows stay zero, and realistic states round-trip within a few percent."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3 * 256, generator=gen)
    x[0] *= 200.0  # an attention-sink-like outlier row must not hurt the others
    x[1] = 0.0
    q, scale = quantize_fp8(x)
    assert torch.allclose(scale, x.abs().amax(-1) / FP8_MAX) and q.dtype == torch.float8_e4m3fn
    back = dequantize_fp8(q, scale, torch.float32)
    assert torch.equal(back[1], torch.zeros_like(back[1])) and torch.isfinite(back).all()
    row_err = (back - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-12)
    assert row_err[2:].max() < 0.05  # e4m3 has 3 mantissa bits: ~2-3% rms per row
    err = fp8_error(x)
    assert 0 < err["rel_rms"] < 0.05 and err["max_abs"] <= x.abs().max().item() / 8


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
    rows = [{"id": f"src:{i}", "split": "val" if i % 4 == 0 else "train", "input_ids": [1] * n, "loss_mask": [1] * n,
             "num_tokens": n, "num_loss_tokens": n, "truncated": False} for i, n in enumerate(lengths)]
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
    fdir = _features(tmp_path, spec)
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


def patterned_samples(spec: FeatureSpec, lengths: list[int], prefix: str = "s") -> list[CapturedSample]:
    """Samples whose values follow fixed integer patterns (no random generator), for golden bytes."""
    out, base = [], 0
    for i, n in enumerate(lengths):
        rows = torch.arange(base, base + n)
        sample = CapturedSample(id=f"{prefix}{i}", input_ids=rows % VOCAB, loss_mask=(rows % 3 == 0).to(torch.uint8),
                                aux=((torch.arange(n * 3 * H) + base * 3 * H) % 97 - 48).reshape(n, 3 * H) / 8)
        if spec.supervision == "final_hidden":
            sample.final = ((torch.arange(n * H) + base * H) % 89 - 44).reshape(n, H) / 16
        else:
            sample.topk_ids = ((torch.arange(n * K) + base * K) % VOCAB).reshape(n, K)
            sample.topk_logprobs = -((torch.arange(n * K) + base * K) % 13).reshape(n, K).float() / 4
        out.append(sample)
        base += n
    return out


def _request(samples: list[CapturedSample]) -> list[SampleTokens]:
    return [SampleTokens(s.id, s.input_ids.tolist(), s.loss_mask.tolist()) for s in samples]


@pytest.mark.parametrize("aux_dtype,supervision", list(PAYLOAD_SHA256))
def test_streamed_shard_matches_golden_payload(tmp_path, monkeypatch, aux_dtype, supervision):
    """Samples streamed one at a time (later regions held for file order, early writeback and a hash
    backlog bound hit on every piece) give the golden payload, a done file whose sha256 and size are the
    file's, and the same bytes and done document as write_shard."""
    monkeypatch.setattr(shards, "WRITEBACK_BYTES", 1)
    monkeypatch.setattr(shards, "HASH_BACKLOG_BYTES", 1)
    spec = make_spec(aux_dtype, supervision)
    samples = patterned_samples(spec, [5, 1, 9])
    stream = ShardStream(shard_path(tmp_path, 0), spec, _request(samples))
    for sample in samples:
        stream.append([sample])
    stream.seal()
    doc = stream.commit()
    data = shard_path(tmp_path, 0).read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    assert hashlib.sha256(data[8 + header_len:]).hexdigest() == PAYLOAD_SHA256[(aux_dtype, supervision)]
    assert doc["sha256"] == hashlib.sha256(data).hexdigest() and doc["num_bytes"] == len(data)
    whole = write_shard(shard_path(tmp_path, 1), spec, samples, _request(samples))
    assert shard_path(tmp_path, 1).read_bytes() == data and {**whole, "file": doc["file"]} == doc


def test_stream_refuses_unrequested_or_missing_samples_and_abort_cleans_up(tmp_path):
    """A sample other than the next requested one, or sealing before all arrived, raises naming the sample;
    abort leaves neither the shard, nor a done file, nor a temp file."""
    spec = make_spec()
    fdir = _features(tmp_path, spec)
    samples = make_samples(spec, [3, 4, 2])
    stream = ShardStream(shard_path(fdir, 0), spec, _request(samples))
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
            sample = CapturedSample(id=req.id, input_ids=ids, loss_mask=torch.tensor(req.loss_mask, dtype=torch.uint8),
                                    aux=(ids[:, None] * torch.arange(1, 3 * H + 1) % 31 - 15).float() / 4)
            if self.spec.supervision == "final_hidden":
                sample.final = (ids[:, None] * torch.arange(1, H + 1) % 29 - 14).float() / 8
            else:
                sample.topk_ids = (ids[:, None] + torch.arange(K)) % VOCAB
                sample.topk_logprobs = -(ids[:, None] + torch.arange(K)).float() / VOCAB
            if req.id in self.poison:
                sample.aux[n - 1, 0] = float("nan")
            self.num_bytes_out += sum(t.nbytes for t in (sample.aux, sample.final, sample.topk_ids,
                                                         sample.topk_logprobs) if t is not None)
            yield sample

    def close(self) -> None:
        pass


def _requests(num_shards: int, lengths: list[int]) -> list[list[SampleTokens]]:
    return [[SampleTokens(f"j{j}-s{i}", [(7 * j + 3 * i + t) % VOCAB for t in range(n)], [t % 2 for t in range(n)])
             for i, n in enumerate(lengths)] for j in range(num_shards)]


def _jobs(fdir: Path, requests: list[list[SampleTokens]]) -> list[tuple[Path, list[SampleTokens]]]:
    return [(shard_path(fdir, j), samples) for j, samples in enumerate(requests)]


@pytest.mark.parametrize("aux_dtype,supervision", [("bfloat16", "final_hidden"), ("float8_e4m3fn", "topk_logprobs")])
def test_writer_pool_gives_identical_shards_for_any_number_of_writers(tmp_path, aux_dtype, supervision):
    """Whole shards with one writer (the previous scheme), and streaming with 1 or 3 writers and a queue of
    a few samples, give byte-identical shard and done files, every one complete and verified."""
    spec = make_spec(aux_dtype, supervision)
    requests = _requests(5, [6, 2, 9, 4])
    variants = {"whole-1": WriteOptions(stream=False, num_writers=1), "stream-1": WriteOptions(num_writers=1),
                "stream-3-small-queue": WriteOptions(num_writers=3, queue_bytes=3 * 9 * 4 * H * 4)}
    files = {}
    for name, options in variants.items():
        fdir = _features(tmp_path / name, spec)
        docs = capture_and_write(FakeCaptureBackend(spec), spec, _jobs(fdir, requests), options=options)
        assert [d["file"] for d in docs] == [shard_path(fdir, j).name for j in range(5)]
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
@pytest.mark.parametrize("options", [WriteOptions(stream=False, num_writers=1), WriteOptions(num_writers=1),
                                     WriteOptions(num_writers=3)], ids=["whole-1", "stream-1", "stream-3"])
def test_failed_writer_names_its_shard_and_no_later_shard_is_complete(tmp_path, monkeypatch, options, failure):
    """A bad sample or a disk error in shard 1 raises ShardWriteError naming shard-00001 (and the sample);
    shard 0 is complete, no later shard has a done file, and no temp file is left behind."""
    spec = make_spec()
    fdir = _features(tmp_path, spec)
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
    fdir = _features(tmp_path, spec)
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
    docs = capture_and_write(backend, spec, _jobs(fdir, requests), options=WriteOptions(num_writers=2,
                                                                                        queue_bytes=limit), stats=stats)
    assert len(docs) == 3 and sorted(ShardReader(fdir).shards) == [0, 1, 2]
    assert max(ahead) <= limit and max(ahead) >= limit - sample_bytes
    assert stats.num_waits > 0 and stats.peak_queued_bytes <= limit

