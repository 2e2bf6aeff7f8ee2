"""The HF capture backend on the tiny model, and the capture stage functions in-process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eagle3.config import RunConfig, TinyTargetConfig, load_config
from eagle3.features import hf_backend
from eagle3.features.attention import ATTENTION
from eagle3.features.batching import plan_batches
from eagle3.features.capture import MANIFEST_FILE, capture_shard, features_dir, prepare_capture, run_capture
from eagle3.features.hf_backend import HFCaptureBackend
from eagle3.features.hf_models import clear_model_cache, get_model
from eagle3.features.run_spec import SpecMismatchError
from eagle3.features.shards.reader import ShardReader
from eagle3.features.spec import SampleTokens
from eagle3.target.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny_target
from infra.storage import DiskSpaceError

NUM_LAYERS = 8
LENGTHS = [17, 40, 25, 33, 64, 12, 90]  # >= 12 tokens: MKL picks one GEMM kernel for all of these row counts


def _model():
    return build_tiny_model(build_tiny_tokenizer(), TinyTargetConfig(num_hidden_layers=NUM_LAYERS), seed=0)


@pytest.fixture(scope="module")
def samples() -> list[SampleTokens]:
    gen = torch.Generator().manual_seed(0)
    return [
        SampleTokens(f"s{i}", torch.randint(0, 300, (n,), generator=gen).tolist(), [i % 2] * n)
        for i, n in enumerate(LENGTHS)
    ]


@pytest.fixture(scope="module")
def reference():
    """An untouched tiny model (stock SDPA attention) for output_hidden_states references."""
    return _model()


def _backend(aux=(0, 1, 2), budget=4096, **kwargs) -> HFCaptureBackend:
    return HFCaptureBackend(None, list(aux), model=_model(), device="cpu", tokens_per_forward=budget, **kwargs)


def test_hooks_equal_output_hidden_states(samples, reference):
    """Aux id j equals HF hidden_states[j+1] bitwise, and the final state equals hidden_states[-1]."""
    backend = _backend(aux=(0, 1, 2))
    for sample, got in zip(samples, backend.capture(samples)):
        with torch.no_grad():
            ids = torch.tensor([sample.input_ids])
            ref = reference.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        expected = torch.cat([ref.hidden_states[j + 1][0] for j in (0, 1, 2)], dim=-1)  # [T, 3H]
        assert torch.equal(got.aux, expected) and torch.equal(got.final, ref.hidden_states[-1][0])
        assert got.id == sample.id and got.input_ids.tolist() == sample.input_ids


def test_final_state_is_post_norm(samples):
    """The stored final state is norm(output of the last layer), i.e. HF's hidden_states[-1] is post-norm."""
    backend = _backend(aux=(NUM_LAYERS - 1,))
    got = next(iter(backend.capture(samples[:1])))
    with torch.no_grad():
        normed = backend.decoder.norm(got.aux)
    assert torch.equal(got.final, normed) and not torch.allclose(got.final, got.aux)


def test_batched_equals_unbatched_bitwise(samples):
    """A token budget of 1 (each sample alone) and a large budget (one padded batch) give bitwise equal states."""
    large, single = _backend(budget=4096), _backend(budget=1)
    assert len(large.batches(samples)) == 1 and len(single.batches(samples)) == len(samples)
    for a, b in zip(large.capture(samples), single.capture(samples)):
        assert a.id == b.id and torch.equal(a.aux, b.aux) and torch.equal(a.final, b.final)


def test_stock_attention_with_padding_is_close(samples):
    """With per-sample attention off, padded batches still match lone samples to float rounding."""
    large, single = _backend(budget=4096, batch_invariant=False), _backend(budget=1, batch_invariant=False)
    assert not large.per_sample
    for a, b in zip(large.capture(samples), single.capture(samples)):
        assert torch.allclose(a.aux, b.aux, atol=1e-5, rtol=1e-5) and torch.allclose(a.final, b.final, atol=1e-5)


def test_same_inputs_give_bitwise_same_outputs(samples):
    """Two captures of the same samples with the same budget are bitwise identical."""
    backend = _backend(budget=100)
    first, second = list(backend.capture(samples)), list(backend.capture(samples))
    assert all(torch.equal(a.aux, b.aux) and torch.equal(a.final, b.final) for a, b in zip(first, second))


def test_topk_logprobs_equal_log_softmax_topk(samples, reference, monkeypatch):
    """Top-K supervision equals log_softmax(logits).topk of the full model, also when logits are chunked."""
    monkeypatch.setattr(hf_backend, "LOGITS_CHUNK_BYTES", 4 * 384 * 7)  # 7 tokens per chunk
    backend = _backend(supervision="topk_logprobs", topk=5)
    for sample, got in zip(samples[:3], backend.capture(samples[:3])):
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([sample.input_ids]), use_cache=False).logits[0]
        values, ids = torch.log_softmax(logits.float(), -1).topk(5, -1)
        assert got.final is None and got.topk_ids.dtype == torch.int32
        assert torch.equal(got.topk_ids, ids.to(torch.int32))
        assert torch.allclose(got.topk_logprobs, values, atol=1e-5)


def test_capture_many_equals_capture_per_group(samples):
    """One pipeline through several groups tags every sample with its group and gives bitwise the states of
    capturing each group alone (batches never span groups)."""
    backend = _backend(budget=100)
    groups = [samples[:3], samples[3:4], samples[4:]]
    tagged = list(backend.capture_many(iter(groups)))
    assert [(g, s.id) for g, s in tagged] == [(g, s.id) for g, group in enumerate(groups) for s in group]
    alone = [s for group in groups for s in backend.capture(group)]
    assert all(torch.equal(a.aux, b.aux) and torch.equal(a.final, b.final) for (_, a), b in zip(tagged, alone))


def test_token_budget_batches():
    """Padded size (count x longest) stays within budget, order is kept, and an over-long sample runs alone."""
    lengths = [10, 30, 20, 200, 5, 50, 50, 50]
    batches = plan_batches(lengths, 100)
    assert [i for b in batches for i in b] == list(range(len(lengths)))
    assert batches == [[0, 1, 2], [3], [4, 5], [6, 7]]
    assert all(len(b) * max(lengths[i] for i in b) <= 100 or len(b) == 1 for b in batches)


def test_no_hooks_left_behind(samples):
    """After a capture the shared model carries no forward hooks (another backend may use it next)."""
    backend = _backend()
    list(backend.capture(samples[:2]))
    modules = [*backend.decoder.layers, backend.decoder.norm]
    assert all(not m._forward_hooks for m in modules)


def test_get_model_is_cached_per_target(tmp_path):
    """get_model loads a target once per process: the second call returns the same object."""
    target = save_tiny_target(tmp_path / "t", TinyTargetConfig(), 0)
    try:
        first = get_model(target, "float32", "cpu")
        assert get_model(target, "float32", "cpu") is first
        assert first.config._attn_implementation == ATTENTION
    finally:
        clear_model_cache()


# ---- the stage functions ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    """Tokenized tiny data (built once) plus the tiny target cache."""
    from eagle3.run.stages import run_all

    root = tmp_path_factory.mktemp("tiny-base")
    run_all(load_config("tiny", [f"run.workdir={root}", f"target.cache_dir={root / '_targets'}"]))
    return root


def tiny_run(base: Path, workdir: Path, *overrides: str) -> RunConfig:
    """A fresh tiny run directory holding a copy of the tokenized data."""
    shutil.copytree(base / "tiny" / "data", workdir / "tiny" / "data")
    return load_config("tiny", [f"run.workdir={workdir}", f"target.cache_dir={base / '_targets'}", *overrides])


def test_prepare_refuses_a_changed_spec(tiny_base, tmp_path):
    """A spec.json written for other features stops prepare, naming the fields, and keeps the old manifest."""
    cfg = tiny_run(tiny_base, tmp_path, "capture.tokens_per_shard=3000")
    run_capture(cfg)
    changed = load_config(
        "tiny",
        [
            f"run.workdir={tmp_path}",
            f"target.cache_dir={tiny_base / '_targets'}",
            "capture.tokens_per_shard=3000",
            "capture.aux_dtype=float8_e4m3fn",
            "capture.dtype=float16",
        ],
    )
    with pytest.raises(SpecMismatchError, match="aux_dtype: 'bfloat16' -> 'float8_e4m3fn'") as err:
        run_capture(changed)
    assert "dtype: 'bfloat16' -> 'float16'" in str(err.value)
    assert (features_dir(cfg) / MANIFEST_FILE).is_file() and not run_capture(cfg).computed


def test_preflight_refuses_when_disk_is_small(tiny_base, tmp_path, monkeypatch):
    """With too little free space prepare raises naming both numbers and the mode that fits, and writes no shard."""
    cfg = tiny_run(tiny_base, tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 10_000, 10_000))
    with pytest.raises(DiskSpaceError, match="10,000 are free") as err:
        prepare_capture(cfg)
    assert "need" in str(err.value) and not list(features_dir(cfg).glob("shard-*"))
    assert "train.features=online needs no feature disk" in str(err.value)


def test_capture_shard_skips_a_matching_shard(tiny_base, tmp_path):
    """A shard whose done file matches the plan is not recomputed; counts come from the done file."""
    cfg = tiny_run(tiny_base, tmp_path, "capture.tokens_per_shard=2000")
    plan = prepare_capture(cfg)
    assert plan.summary().pending == [s.index for s in plan.shards] and len(plan.shards) > 1
    first = capture_shard(cfg, 1)
    again = capture_shard(cfg, 1)
    assert first.computed and not again.computed
    assert again.num_tokens == first.num_tokens == plan.shards[1].num_tokens
    assert prepare_capture(cfg).pending == tuple(s.index for s in plan.shards if s.index != 1)


def test_run_capture_topk_fp8_covers_every_sample(tiny_base, tmp_path):
    """run_capture with top-K + fp8 stores every tokenized sample once, readable, hashes verified; rerun skips."""
    import pyarrow.parquet as pq

    cfg = tiny_run(
        tiny_base,
        tmp_path,
        "capture.tokens_per_shard=2500",
        "capture.supervision=topk_logprobs",
        "capture.topk=4",
        "capture.aux_dtype=float8_e4m3fn",
        "capture.tokens_per_forward=600",
    )
    outcome = run_capture(cfg)
    ids = pq.read_table(cfg.run_dir / "data" / "tokenized.parquet", columns=["id"])["id"].to_pylist()
    reader = ShardReader(features_dir(cfg))
    assert reader.ids() == ids and outcome.stats["num_samples"] == len(ids)
    assert all(reader.verify(i) for i in reader.shards)
    sample = reader.get(ids[-1])
    assert sample["aux"].dtype == torch.bfloat16 and sample["topk_ids"].shape == (len(sample["input_ids"]), 4)
    manifest = json.loads((features_dir(cfg) / MANIFEST_FILE).read_text())
    assert manifest["stage"] == "capture" and manifest["key"] == outcome.key
    last_run = manifest["stats"]["last_run"]  # this run's own figures: every token, a positive rate
    assert last_run["num_tokens"] == outcome.stats["num_tokens"]
    assert last_run["num_shards"] == manifest["stats"]["num_shards"]
    assert last_run["tokens_per_s"] > 0 and last_run["elapsed_s"] > 0 and last_run["writer_wait_s"] >= 0
    assert not run_capture(cfg).computed


def _shard_files(cfg: RunConfig) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(features_dir(cfg).glob("shard-*"))}


def test_run_capture_streamed_and_whole_shards_are_identical(tiny_base, tmp_path):
    """run_capture writing whole shards with one writer (the previous scheme) and streaming them with three
    writers and a small queue give byte-identical shards and done files under the same stage key."""
    common = ("capture.tokens_per_shard=1500", "capture.tokens_per_forward=600")
    whole = tiny_run(tiny_base, tmp_path / "whole", *common, "capture.stream_writes=false", "capture.num_writers=1")
    streamed = tiny_run(
        tiny_base, tmp_path / "streamed", *common, "capture.num_writers=3", "capture.write_queue_bytes=200000"
    )
    first, second = run_capture(whole), run_capture(streamed)
    assert first.key == second.key and first.stats["num_shards"] > 2
    assert _shard_files(whole) == _shard_files(streamed) and len(_shard_files(whole)) == 2 * first.stats["num_shards"]


def test_per_sample_attention_knob_reaches_the_backend_and_keeps_the_key(tiny_base, tmp_path):
    """capture.per_sample_attention=false gives a padded-attention backend; the capture key does not change
    (like the batch size, it moves results by rounding only)."""
    from eagle3.features.capture import capture_key, make_backend
    from eagle3.features.run_spec import build_spec
    from eagle3.target.load import prepare_target

    on, off = (
        tiny_run(tiny_base, tmp_path),
        load_config(
            "tiny",
            [
                f"run.workdir={tmp_path}",
                f"target.cache_dir={tiny_base / '_targets'}",
                "capture.per_sample_attention=false",
            ],
        ),
    )
    model_dir = prepare_target(on)
    spec = build_spec(on, model_dir)
    backends = [make_backend(cfg, model_dir, spec) for cfg in (on, off)]
    assert [b.per_sample for b in backends] == [True, False]
    assert capture_key(on, spec) == capture_key(off, spec)


def test_capture_cli_does_nothing_for_a_run_that_trains_online(tmp_path, capsys):
    """`python -m eagle3.features.capture` on a config that trains online says why it skips and writes no feature."""
    from eagle3.features.capture import main
    from eagle3.run.registry import ONLINE_SKIP

    overrides = ["train.features=online", f"run.workdir={tmp_path}"]
    main(["--preset", "tiny", *(a for o in overrides for a in ("--set", o))])
    assert json.loads(capsys.readouterr().out) == {"capture": ONLINE_SKIP}
    assert not features_dir(load_config("tiny", overrides)).exists()
