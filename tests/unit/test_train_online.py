"""Online training (train.features=online): the same features, losses, gradients and resume as offline."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from eagle3.train.loop import train
from eagle3.train.metrics import read_metrics
from tests.unit.test_train_helpers import load_run_config, real_tiny_run

OVERRIDES = [
    "train.tokens_per_row=1024",
    "train.grad_accum_steps=2",
    "train.num_epochs=2",
    "train.max_steps=4",
    "train.lr=1e-3",
    "train.warmup_steps=1",
    "train.eval_every_steps=2",
    "train.checkpoint_every_steps=0",
    "train.aux_noise=uniform",
    "train.progress_every_s=0",
]
ONLINE = ["train.features=online"]


def _online_run(path, overrides):
    """A copy of the tiny run with its captured features deleted, set to train online."""
    cfg = load_run_config(real_tiny_run(path, overrides + ONLINE))
    shutil.rmtree(cfg.run_dir / "features")
    return cfg


def _records(cfg, kind="train"):
    return read_metrics(cfg.run_dir / "train" / "metrics.jsonl", kind)


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    cfg = load_run_config(real_tiny_run(tmp_path_factory.mktemp("offline") / "runs", OVERRIDES))
    return cfg, train(cfg)


@pytest.fixture(scope="module")
def online(tmp_path_factory):
    cfg = _online_run(tmp_path_factory.mktemp("online") / "runs", OVERRIDES)
    return cfg, train(cfg)


def test_online_rows_hold_the_captured_features(tmp_path):
    """A packed row filled online equals the same row collated from the capture shards, value for value."""
    from eagle3.target.load import prepare_target
    from eagle3.train.build import plan_data, read_inputs
    from eagle3.train.data import RowLoader
    from eagle3.train.online import OnlineFeatures, TokenReader

    cfg = load_run_config(real_tiny_run(tmp_path / "runs", OVERRIDES))
    inputs = read_inputs(cfg, prepare_target(cfg))
    rows = plan_data(cfg, inputs, 1).train[0].rows[:3]
    online = OnlineFeatures.from_config(cfg, inputs.model_dir, inputs.spec, torch.device("cpu"))
    shard_rows = RowLoader(inputs.features_dir, list(rows), 1024, torch.float32, depth=0)
    token_rows = RowLoader(
        inputs.features_dir, list(rows), 1024, torch.float32, depth=0, reader=TokenReader(inputs.tokenized)
    )
    checked = 0
    for want, got in zip(shard_rows, token_rows):
        assert got.batch.aux is None and len(got.lengths) >= 2  # packed rows of several documents
        filled = online.fill(got.batch, list(got.lengths), torch.float32)
        assert torch.equal(filled.input_ids, want.batch.input_ids)
        torch.testing.assert_close(filled.aux, want.batch.aux, rtol=0, atol=0)
        torch.testing.assert_close(filled.final_hidden, want.batch.final_hidden, rtol=0, atol=0)
        checked += 1
    assert checked == 3


STEP_ONE = [*OVERRIDES, "train.max_steps=1", "train.eval_every_steps=0"]


def test_online_step_one_loss_and_update_equal_offline(tmp_path):
    """Step 1 online gives offline's loss and grad norm, and after one AdamW update offline's weights."""
    cfg_on = _online_run(tmp_path / "on", STEP_ONE)
    cfg_off = load_run_config(real_tiny_run(tmp_path / "off", STEP_ONE))
    on, off = train(cfg_on), train(cfg_off)
    got, want = _records(cfg_on)[0], _records(cfg_off)[0]
    assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"])
    a, b = load_file(on.checkpoint / "model.safetensors"), load_file(off.checkpoint / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_online_metrics_match_offline_after_n_steps(offline, online):
    """Every train and validation metric of a 4-step run is the same online as offline."""
    (cfg_off, _), (cfg_on, res_on) = offline, online
    assert (res_on.status, res_on.step) == ("done", 4)
    for kind in ("train", "eval"):
        off, on = _records(cfg_off, kind), _records(cfg_on, kind)
        assert [r["step"] for r in on] == [r["step"] for r in off] and on
        for a, b in zip(on, off):
            for key in ("loss", "acc_0", "acc_1", "accept_len_est"):
                if key in b:
                    assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (kind, a["step"], key)


def test_online_resume_matches_uninterrupted(online, tmp_path):
    """Online: 2 steps, stop, resume for 2 more: the same losses and final weights as the straight run."""
    cfg_full, full = online
    cfg = _online_run(tmp_path / "runs", OVERRIDES)
    first, second = train(cfg, stop_after_steps=2), train(cfg)
    assert (first.status, first.step, second.status, second.step) == ("stopped", 2, "done", 4)
    got, want = _records(cfg), _records(cfg_full)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert all(abs(a["loss"] - b["loss"]) <= 1e-6 for a, b in zip(got, want))
    a, b = load_file(second.checkpoint / "model.safetensors"), load_file(full.checkpoint / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_online_run_writes_the_spec_and_no_shards(online):
    """Online training leaves features/spec.json (what export reads) and no feature shard on disk."""
    cfg, _ = online
    fdir = cfg.run_dir / "features"
    assert (fdir / "spec.json").is_file()
    assert not list(fdir.glob("shard-*"))


@pytest.mark.parametrize(
    "capture",
    [["capture.supervision=topk_logprobs", "capture.topk=4"], ["capture.aux_dtype=float8_e4m3fn"]],
    ids=["topk", "fp8"],
)
def test_online_rows_equal_captured_rows_for_topk_and_fp8(tmp_path, capture):
    """Top-K supervision and fp8 aux: rows filled online equal the rows collated from a capture with those settings."""
    from eagle3.config import load_config
    from eagle3.features.capture import run_capture
    from eagle3.run.stages import run_all
    from eagle3.target.load import prepare_target
    from eagle3.train.build import plan_data, read_inputs
    from eagle3.train.data import RowLoader
    from eagle3.train.online import OnlineFeatures, TokenReader

    cfg = load_config("tiny", [f"run.workdir={tmp_path}", "train.tokens_per_row=1024", *capture])
    run_all(cfg)
    run_capture(cfg)
    inputs = read_inputs(cfg, prepare_target(cfg))
    rows = list(plan_data(cfg, inputs, 1).train[0].rows[:2])
    online = OnlineFeatures.from_config(cfg, inputs.model_dir, inputs.spec, torch.device("cpu"))
    stored = RowLoader(inputs.features_dir, rows, 1024, torch.float32, depth=0)
    tokens = RowLoader(inputs.features_dir, rows, 1024, torch.float32, depth=0, reader=TokenReader(inputs.tokenized))
    names = ("aux", "topk_ids", "topk_logprobs") if "topk" in capture[0] else ("aux", "final_hidden")
    for want, got in zip(stored, tokens):
        filled = online.fill(got.batch, list(got.lengths), torch.float32)
        for name in names:
            assert torch.equal(getattr(filled, name), getattr(want.batch, name)), name


@pytest.mark.parametrize(
    ("gib", "host_gib"),
    [(1.0, 0.0), (2e-4, 0.0), (2e-4, 1.0)],
    ids=["every-document", "a-few-documents", "the-rest-in-host-memory"],
)
def test_the_feature_cache_changes_no_metric_or_weight(online, tmp_path, caplog, gib, host_gib):
    """train.feature_cache_gib (and _host_gib): later epochs and validations take kept documents' states from the
    cache (hits logged), rows mixing kept and new documents included, and every metric and final weight equals the
    run without it."""
    cfg_plain, plain = online
    cfg = _online_run(
        tmp_path / "runs", [*OVERRIDES, f"train.feature_cache_gib={gib}", f"train.feature_cache_host_gib={host_gib}"]
    )
    with caplog.at_level("INFO", logger="eagle3.train"):
        cached = train(cfg)
    lines = [r.getMessage() for r in caplog.records if "feature cache:" in r.getMessage()]
    assert lines and " 0.0% of" not in lines[-1], lines
    assert (" 0 over the budget" in lines[-1]) == (gib == 1.0 or host_gib > 0), lines[-1]
    assert ("hits from there" in lines[-1]) == (host_gib > 0) and " 0 hits from there" not in lines[-1], lines[-1]
    for kind in ("train", "eval"):
        got, want = _records(cfg, kind), _records(cfg_plain, kind)
        assert [r["step"] for r in got] == [r["step"] for r in want] and got
        for a, b in zip(got, want):
            assert all(a[k] == b[k] for k in ("loss", "acc_0", "accept_len_est") if k in b), (kind, a["step"])
    a, b = load_file(cached.checkpoint / "model.safetensors"), load_file(plain.checkpoint / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)
