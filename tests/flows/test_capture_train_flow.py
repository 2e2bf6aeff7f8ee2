"""Capture and train flows under a real Prefect server (tiny preset): shards, skipping, torchrun training."""

from __future__ import annotations

import json

import pytest

from eagle3.config import load_config
from flows.capture import eagle3_capture
from flows.pipeline import eagle3_pipeline
from flows.train import eagle3_train


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("capture-train")
    config = load_config("tiny", [f"run.workdir={workdir}", "train.max_steps=6", "train.eval_every_steps=3"])
    eagle3_pipeline(config=config, until="vocab")
    return config


def test_capture_flow_writes_every_shard_and_a_manifest(cfg):
    """All planned shards are captured and the capture manifest counts every tokenized token."""
    manifest = eagle3_capture(config=cfg)
    fdir = cfg.run_dir / "features"
    plan = json.loads((fdir / "plan.json").read_text())
    assert manifest["stats"]["num_shards"] == len(plan["shards"]) > 1
    assert manifest["stats"]["num_tokens"] == plan["num_tokens"]
    assert len(list(fdir.glob("shard-*.done.json"))) == len(plan["shards"])


def test_capture_rerun_skips_complete_shards(cfg):
    """A second capture finds every shard complete and rewrites none of them."""
    fdir = cfg.run_dir / "features"
    before = {p.name: p.stat().st_mtime_ns for p in fdir.glob("shard-*.safetensors")}
    eagle3_capture(config=cfg)
    assert {p.name: p.stat().st_mtime_ns for p in fdir.glob("shard-*.safetensors")} == before


def test_train_flow_runs_torchrun_and_publishes_metrics(cfg):
    """The GPU-tagged train task launches torchrun (CPU here), which writes a manifest and metrics."""
    result = eagle3_train(config=cfg)
    assert result["last_train"]["step"] == 6
    assert result["last_eval"] is not None and "acc_0" in result["last_eval"]
    assert (cfg.run_dir / "train" / "train.manifest.json").is_file()
    assert (cfg.run_dir / "train" / "loss.png").stat().st_size > 1000


def test_train_rerun_is_a_no_op(cfg):
    """Training again with the same inputs leaves the final checkpoint untouched."""
    ckpts = sorted((cfg.run_dir / "train" / "checkpoints").iterdir())
    stamp = ckpts[-1].stat().st_mtime_ns
    eagle3_train(config=cfg)
    assert sorted((cfg.run_dir / "train" / "checkpoints").iterdir()) == ckpts
    assert ckpts[-1].stat().st_mtime_ns == stamp


def test_full_pipeline_after_capture_and_train_recomputes_nothing(cfg):
    """The end-to-end flow (data, capture subflow, train task) on a finished run rewrites no shard or checkpoint."""
    stamps = {p: p.stat().st_mtime_ns for p in cfg.run_dir.rglob("*.safetensors")}
    result = eagle3_pipeline(config=cfg)
    assert not any(result[s]["computed"] for s in ("merge", "tokenize", "vocab"))
    assert result["capture"]["stats"]["num_tokens"] > 0 and result["train"]["last_train"]["step"] == 6
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
