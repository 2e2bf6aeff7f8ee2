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
    result = eagle3_pipeline(config=cfg, until="train")
    assert not any(result[s]["computed"] for s in ("merge", "tokenize", "vocab"))
    assert result["capture"]["stats"]["num_tokens"] > 0 and result["train"]["last_train"]["step"] == 6
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_pipeline_exports_and_evaluates_and_reports(cfg):
    """until=evaluate: the SGLang export and the measured evaluation exist, lossless on every prompt; a run report."""
    from prefect.client.orchestration import get_client

    cfg2 = cfg.model_copy(update={"evaluate": cfg.evaluate.model_copy(update={"num_prompts": 2, "max_new_tokens": 12})})
    result = eagle3_pipeline(config=cfg2, until="evaluate")
    assert (cfg.run_dir / "export" / "sglang" / "config.json").is_file()
    records = json.loads((cfg.run_dir / "eval" / "results.json").read_text())["results"]
    assert {r["method"] for r in records} >= {"ngram"} and all(r["num_prompts"] == 2 for r in records)
    assert all(r["lossless"]["identical"] == 2 for r in records) and all(r["accept_len"] >= 1.0 for r in records)
    assert result["evaluate"]["computed"] and "benchmark" not in result
    with get_client(sync_client=True) as client:
        report = client.read_artifacts(limit=200)
    keys = {a.key for a in report}
    assert f"{cfg.run.name}-run-report" in keys and f"{cfg.run.name}-evaluate-progress" in keys
