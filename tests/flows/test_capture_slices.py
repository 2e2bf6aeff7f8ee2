"""The sliced capture's parent under a real Prefect server, with the slice runs faked in-process: re-submission
of a Crashed slice only, refusal of a Cancelled one, finalizing only when every shard is complete."""

from __future__ import annotations

import json

import pytest

import flows.capture as capture_flow
from eagle3.config import load_config
from eagle3.features.capture import capture_shard
from eagle3.run.stages import run_all
from tests.fakes.slice_runs import fake_slice_runs


@pytest.fixture
def cfg(tmp_path):
    config = load_config("tiny", [f"run.workdir={tmp_path}", "capture.num_slices=3", "capture.tokens_per_shard=1000"])
    run_all(config)
    return config


def _fake_slices(monkeypatch, outcome):
    """Fake slice runs (tests/fakes/slice_runs.py) that capture their shards; returns the submitted (name, shards)."""

    def work(parameters):
        for index in parameters["shards"]:
            capture_shard(parameters["config"], index)

    return fake_slice_runs(monkeypatch, capture_flow.SLICE_DEPLOYMENT, outcome, work, lambda p: list(p["shards"]))


def test_a_crashed_slice_is_submitted_again_and_the_capture_completes(cfg, monkeypatch):
    """Slice 1 crashes on its first run: only it is submitted again, with the same shards; the three slices
    are disjoint and cover the plan, and the manifest counts every planned shard."""
    submitted = _fake_slices(monkeypatch, lambda name: "CRASHED" if name.endswith("slice1-try1") else "COMPLETED")
    manifest = capture_flow.eagle3_capture(config=cfg)
    plan = json.loads((cfg.run_dir / "features" / "plan.json").read_text())
    names = [n for n, _ in submitted]
    assert names == [
        "capture-tiny-slice0-try1",
        "capture-tiny-slice1-try1",
        "capture-tiny-slice2-try1",
        "capture-tiny-slice1-try2",
    ]
    assert submitted[1][1] == submitted[3][1]
    assert sorted(i for _, shards in submitted[:3] for i in shards) == [s["index"] for s in plan["shards"]]
    assert manifest["stats"]["num_shards"] == len(plan["shards"]) >= 3


def test_a_cancelled_slice_stops_the_capture_without_a_manifest(cfg, monkeypatch):
    """A slice run that ends Cancelled is not submitted again, and no manifest is written."""
    submitted = _fake_slices(monkeypatch, lambda name: "CANCELLED" if "slice2" in name else "COMPLETED")
    with pytest.raises(RuntimeError, match="CANCELLED"):
        capture_flow.eagle3_capture(config=cfg)
    assert len(submitted) == 3
    assert not (cfg.run_dir / "features" / "capture.manifest.json").exists()


def test_slices_that_keep_failing_end_after_the_bounded_rounds(cfg, monkeypatch):
    """A slice that fails every time is submitted MAX_SLICE_ROUNDS times, then the capture fails naming it."""
    submitted = _fake_slices(monkeypatch, lambda name: "FAILED" if "slice0" in name else "COMPLETED")
    with pytest.raises(RuntimeError, match=r"slices \[0\] failed 3 times"):
        capture_flow.eagle3_capture(config=cfg)
    assert [n for n, _ in submitted if "slice0" in n] == [f"capture-tiny-slice0-try{k}" for k in (1, 2, 3)]
