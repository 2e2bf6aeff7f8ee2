"""A stage's key is computed once per run of it: a data stage's task's cache-key function computes it and the task
passes it to the stage as ``known_key`` (tasks.stage_cache.computed_key); the capture flow computes it once and
hands it to its finalize task; the train task hands its key to torchrun's ranks."""

from __future__ import annotations

import os
from pathlib import Path

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


@pytest.fixture
def train_keys(tmp_path, monkeypatch):
    """The lines of a file that counts every computation of the train key (tests.fakes.counting_trainer): this
    process's, through every module that holds eagle3.train.build.stage_key_for, and those of torchrun's ranks,
    which the train task launches as the counting trainer with the same arguments."""
    import dataclasses

    import tasks.train
    from eagle3.train import build, loop, trainer
    from tests.fakes.counting_trainer import LOG_ENV, counted

    log = tmp_path / "train-keys.log"
    log.touch()
    for module in (build, loop, trainer):
        if hasattr(module, "stage_key_for"):
            monkeypatch.setattr(module, "stage_key_for", counted(build.stage_key_for, log))
    real_spec = tasks.train.torchrun_spec
    root = str(Path(__file__).resolve().parents[2])

    def counting_spec(*args, **kwargs):
        spec = real_spec(*args, **kwargs)
        assert spec.module == "eagle3.train"
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        return dataclasses.replace(
            spec, module="tests.fakes.counting_trainer", env={**spec.env, LOG_ENV: str(log), "PYTHONPATH": path}
        )

    monkeypatch.setattr(tasks.train, "torchrun_spec", counting_spec)
    return lambda: log.read_text().splitlines()


def test_train_flow_computes_its_key_once_per_run(tmp_path, train_keys):
    """The train task's key function computes the train key and torchrun's rank takes it (--known-key): one
    computation in a first flow run, the trainer process's included; one in an up-to-date re-run (``Cached``, no
    torchrun); the stage's own run given ``known_key`` computes none."""
    from eagle3.features.capture import run_capture
    from eagle3.run.registry import get_stage, run_data_block
    from eagle3.run.stage import read_manifest
    from eagle3.train import STAGE
    from eagle3.train.stage import run as run_train
    from flows.train import eagle3_train

    cfg = load_config("tiny", [f"run.workdir={tmp_path / 'runs'}", "train.max_steps=2", "train.eval_every_steps=0"])
    run_data_block(cfg)
    run_capture(cfg)

    assert eagle3_train(config=cfg)["computed"] is True
    lines = train_keys()
    started = [line for line in lines if line.startswith("start ")]
    assert len(started) == 1 and started[0] != f"start {os.getpid()}"  # the trainer process counted too
    assert len([line for line in lines if line.startswith("key ")]) == 1

    assert eagle3_train(config=cfg)["computed"] is False
    assert len([line for line in train_keys() if line.startswith("key ")]) == 2

    key = read_manifest(STAGE.manifest(cfg.run_dir))["key"]
    outcome = run_train(cfg, known_key=key)
    assert outcome is not None and not outcome.computed and outcome.key == key
    assert len([line for line in train_keys() if line.startswith("key ")]) == 2
    assert get_stage(STAGE.name).key(cfg) == key  # the key the trainer was handed is the config's
