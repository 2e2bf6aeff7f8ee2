"""A stage's key is computed once per run of it: a data stage's task's cache-key function computes it and the task
passes it to the stage as ``known_key`` (tasks.stage_cache.computed_key); the capture flow computes it once and
hands it to its finalize task."""

from __future__ import annotations

import pytest
from prefect import flow

from eagle3.config import load_config
from eagle3.data.stages import merge
from tasks.data import merge_task
from tasks.stage_cache import UP_TO_DATE


@flow(name="merge-key-count")
def _merge_flow(config, force: bool = False) -> tuple[str, bool]:
    """(the merge task run's state name, whether its outcome says computed)."""
    state = merge_task(config, force, return_state=True)
    return state.name, state.result().computed


@pytest.fixture
def counted(monkeypatch):
    """Every computation of the merge key (the registry, the cache-key function and the stage all call merge.key)."""
    calls = []
    real = merge.key

    def key(cfg):
        calls.append(cfg.run.name)
        return real(cfg)

    monkeypatch.setattr(merge, "key", key)
    return calls


def test_merge_task_computes_its_key_once_per_run(tmp_path, counted):
    """First run: the stage computes (one key computation, not two); an identical re-run is ``Cached`` after one
    computation in the key function; a forced run skips the key function and the stage computes it once."""
    cfg = load_config("tiny", [f"run.workdir={tmp_path}"])

    assert _merge_flow(cfg) == ("Completed", True)
    assert len(counted) == 1

    assert _merge_flow(cfg)[0] == UP_TO_DATE
    assert len(counted) == 2

    assert _merge_flow(cfg, force=True) == ("Completed", True)
    assert len(counted) == 3


@pytest.fixture
def capture_keys(monkeypatch):
    """Every computation of the capture key: the registry's key, the flow's check, the stage's run and the manifest
    it writes all go through eagle3.features.capture.capture_key."""
    from eagle3.features import capture as core

    calls = []
    real = core.capture_key

    def key(cfg, spec):
        calls.append(cfg.run.name)
        return real(cfg, spec)

    monkeypatch.setattr(core, "capture_key", key)
    return calls


def test_capture_flow_computes_its_key_once_per_run(tmp_path, capture_keys):
    """The capture flow computes the stage key once and hands it to its finalize task, which writes the manifest
    with it: one computation on a first run (shards captured, manifest written), one on an up-to-date re-run
    (``Cached``); the stage's own run given ``known_key`` computes none."""
    from eagle3.features.capture import run_capture
    from eagle3.run.registry import run_data_block
    from flows.capture import eagle3_capture

    cfg = load_config("tiny", [f"run.workdir={tmp_path}", "train.features=offline"])
    run_data_block(cfg)

    first = eagle3_capture(config=cfg, return_state=True)
    assert first.is_completed() and first.name != UP_TO_DATE and len(capture_keys) == 1

    again = eagle3_capture(config=cfg, return_state=True)
    assert again.name == UP_TO_DATE and len(capture_keys) == 2

    key = first.result()["key"]
    outcome = run_capture(cfg, force=True, known_key=key)  # checks every shard, writes the manifest again
    assert outcome.computed and outcome.key == key and len(capture_keys) == 2
