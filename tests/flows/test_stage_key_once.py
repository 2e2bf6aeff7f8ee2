"""A data stage's key is computed once per run of its Prefect task: the task's cache-key function computes it and
the task passes it to the stage as ``known_key`` (tasks.stage_cache.computed_key)."""

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
