"""Shard files and fp8 storage: round trips, the done file, validation, completeness as readers see it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3.features.fp8 import FP8_MAX, dequantize_fp8, fp8_error, quantize_fp8
from eagle3.features.shards.check import ShardValidationError
from eagle3.features.shards.done import ShardDone, read_done
from eagle3.features.shards.layout import done_path_for, shard_file_bytes, shard_path, spec_hash
from eagle3.features.shards.reader import CorruptShardError, ShardReader
from eagle3.features.shards.writer import write_shard
from eagle3.features.spec import CapturedSample, SampleTokens
from infra.storage import sha256_file
from tests.unit.shard_samples import VOCAB, make_features_dir, make_samples, make_spec, patterned_samples, request_of

# ---- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("aux_dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
@pytest.mark.parametrize("supervision", ["final_hidden", "topk_logprobs"])
def test_round_trip_every_tensor(tmp_path, aux_dtype, supervision):
    """Every tensor reads back as written (cast to the spec dtypes; fp8 aux = its exact dequantization)."""
    spec = make_spec(aux_dtype, supervision)
    fdir = make_features_dir(tmp_path, spec)
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
    fdir = make_features_dir(tmp_path, spec)
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
    fdir = make_features_dir(tmp_path, spec)
    doc = write_shard(shard_path(fdir, 0), spec, make_samples(spec, [2, 6, 3]))
    on_disk = json.loads(done_path_for(shard_path(fdir, 0)).read_text())
    assert on_disk == doc.to_json() and doc.sample_ids == ["s0", "s1", "s2"] and doc.num_tokens == 11
    assert doc.num_bytes == shard_path(fdir, 0).stat().st_size == shard_file_bytes(spec, doc.sample_ids, 11)
    assert doc.sha256 == sha256_file(shard_path(fdir, 0)) and doc.spec_hash == spec_hash(spec)
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
    a, b = make_features_dir(tmp_path / "a", spec), make_features_dir(tmp_path / "b", spec)
    doc_a = write_shard(shard_path(a, 0), spec, make_samples(spec, [4, 7]))
    doc_b = write_shard(shard_path(b, 0), spec, make_samples(spec, [4, 7]))
    assert doc_a == doc_b and shard_path(a, 0).read_bytes() == shard_path(b, 0).read_bytes()


# The done file the writer before ShardDone (a plain dict) wrote for patterned_samples(make_spec(), [5, 1, 9]):
# the bytes on disk must stay these, and files like it must still load.
GOLDEN_DONE = """{
  "file": "shard-00000.safetensors",
  "format_version": 1,
  "num_bytes": 1619,
  "num_loss_tokens": 5,
  "num_samples": 3,
  "num_tokens": 15,
  "sample_ids": [
    "s0",
    "s1",
    "s2"
  ],
  "sha256": "c76c970beea9e05e1ee7c0c62ba2f4de21fd6586f3847d4940f7972b2fefd77c",
  "spec_hash": "a887397a731ef633088d9bc715060eec27031923c656e930fb6e1b60dcb05434"
}
"""


def test_done_file_bytes_are_golden_and_a_golden_file_loads(tmp_path):
    """A done file written now has the golden bytes; the golden file loads into the same ShardDone, field by field."""
    spec = make_spec()
    samples = patterned_samples(spec, [5, 1, 9])
    doc = write_shard(shard_path(tmp_path, 0), spec, samples, request_of(samples))
    assert done_path_for(shard_path(tmp_path, 0)).read_text() == GOLDEN_DONE
    (tmp_path / "old.done.json").write_text(GOLDEN_DONE)
    loaded = read_done(tmp_path / "old.done.json")
    assert (
        loaded
        == doc
        == ShardDone(
            format_version=1,
            file="shard-00000.safetensors",
            sample_ids=["s0", "s1", "s2"],
            num_samples=3,
            num_tokens=15,
            num_loss_tokens=5,
            num_bytes=1619,
            sha256="c76c970beea9e05e1ee7c0c62ba2f4de21fd6586f3847d4940f7972b2fefd77c",
            spec_hash="a887397a731ef633088d9bc715060eec27031923c656e930fb6e1b60dcb05434",
        )
    )
    assert loaded.to_json() == json.loads(GOLDEN_DONE) and ShardDone.from_json(loaded.to_json()) == loaded


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda d: d.pop("sha256"), r"missing \['sha256'\]"),
        (lambda d: d.update(note=1), r"unexpected \['note'\]"),
        (lambda d: d.update(num_bytes="1619"), r"wrong type: \['num_bytes'\]"),
        (lambda d: d.update(num_tokens=True), r"wrong type: \['num_tokens'\]"),
        (lambda d: d.update(sample_ids=["s0", 1]), r"wrong type: \['sample_ids'\]"),
    ],
)
def test_malformed_done_document_is_refused_and_reads_as_absent(tmp_path, change, needle):
    """A done document with a key missing, unexpected or mistyped is refused naming the key; on disk: no done file."""
    doc = json.loads(GOLDEN_DONE)
    change(doc)
    with pytest.raises(ValueError, match=needle):
        ShardDone.from_json(doc)
    (tmp_path / "shard-00000.done.json").write_text(json.dumps(doc))
    assert read_done(tmp_path / "shard-00000.done.json") is None


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


@pytest.mark.parametrize(
    "corrupt,needle",
    [
        (_short_rows, "aux has shape"),
        (_nan, "non-finite"),
        (_inf_final, "final has 1 non-finite"),
        (_wide, "aux has shape"),
        (_no_final, "final is missing"),
        (_bad_token, "input_ids outside"),
    ],
)
def test_invalid_sample_is_rejected_by_id_and_nothing_written(tmp_path, corrupt, needle):
    """A bad sample raises an error naming its id and the problem; no shard, done or temp file appears."""
    spec = make_spec()
    fdir = make_features_dir(tmp_path, spec)
    samples = make_samples(spec, [4, 6, 5])
    corrupt(samples[1])
    with pytest.raises(ShardValidationError, match=needle) as err:
        write_shard(shard_path(fdir, 0), spec, samples)
    assert "'s1'" in str(err.value) and err.value.sample_id == "s1"
    assert sorted(p.name for p in fdir.iterdir()) == ["spec.json"]


def test_duplicate_id_is_rejected(tmp_path):
    """Two samples with one id in a shard are refused, naming the id; nothing is written."""
    spec = make_spec()
    fdir = make_features_dir(tmp_path, spec)
    samples = make_samples(spec, [3, 3])
    samples[1].id = "s0"
    with pytest.raises(ShardValidationError, match="duplicate") as err:
        write_shard(shard_path(fdir, 0), spec, samples)
    assert "'s0'" in str(err.value) and sorted(p.name for p in fdir.iterdir()) == ["spec.json"]


def test_request_echo_is_checked(tmp_path):
    """States returned for other tokens or in another order than requested are refused."""
    spec = make_spec()
    fdir = make_features_dir(tmp_path, spec)
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
    fdir = make_features_dir(tmp_path, spec)
    samples = make_samples(spec, [3])
    samples[0].aux[1, 1] = 1e6
    with pytest.raises(ShardValidationError, match="non-finite") as err:
        write_shard(shard_path(fdir, 0), spec, samples)
    assert err.value.sample_id == "s0" and not shard_path(fdir, 0).exists()


# ---- completeness as readers see it ------------------------------------------------------------------


def test_reader_ignores_shard_without_done_file(tmp_path):
    """A safetensors file whose done file is missing does not exist for readers."""
    spec = make_spec()
    fdir = make_features_dir(tmp_path, spec)
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
    fdir = make_features_dir(tmp_path, spec)
    write_shard(shard_path(fdir, 0), spec, make_samples(spec, [3], prefix="a"))
    write_shard(shard_path(fdir, 1), spec, make_samples(spec, [4], prefix="b"))
    with open(shard_path(fdir, 1), "ab") as fh:
        fh.write(b"\0")
    assert ShardReader(fdir).ids() == ["a0"]


def test_reader_refuses_a_shard_with_a_flipped_byte_naming_it(tmp_path):
    """A complete shard whose bytes changed (same size) stops the reader at open with the file named."""
    spec = make_spec()
    fdir = make_features_dir(tmp_path, spec)
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
    with pytest.raises(CorruptShardError, match=r"shard-00001\.safetensors does not match the sha256"):
        reader.get("b0")


def test_reader_ignores_shards_of_another_spec_and_temp_files(tmp_path):
    """Shards recorded under another spec hash, and leftover temp files, are invisible."""
    spec = make_spec()
    fdir = make_features_dir(tmp_path, spec)
    write_shard(shard_path(fdir, 0), make_spec(dtype="float32"), make_samples(spec, [3]))
    (fdir / ".shard-00001.safetensors.abc.tmp").write_bytes(b"partial")
    assert len(ShardReader(fdir)) == 0


def test_rewrite_replaces_done_file(tmp_path):
    """Rewriting a shard index with other samples leaves a done file describing only the new bytes."""
    spec = make_spec()
    fdir = make_features_dir(tmp_path, spec)
    write_shard(shard_path(fdir, 0), spec, make_samples(spec, [3, 3], prefix="old"))
    doc = write_shard(shard_path(fdir, 0), spec, make_samples(spec, [5], prefix="new"))
    reader = ShardReader(fdir)
    assert reader.ids() == ["new0"] and doc.sha256 == sha256_file(shard_path(fdir, 0)) and reader.verify(0)


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
