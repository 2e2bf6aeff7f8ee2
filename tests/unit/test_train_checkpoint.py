"""Checkpoints: a full round trip of every piece of state, atomic layout, pruning, refusal of foreign state."""

from __future__ import annotations

import random

import pytest
import torch

from eagle3.target.load import prepare_target
from eagle3.train.build import read_inputs, stage_key_for
from eagle3.train.checkpoint import CheckpointMismatchError, checkpoints_dir, latest_checkpoint, list_checkpoints, prune
from eagle3.train.dist import init_distributed
from eagle3.train.loop import micro_batch_windows, run, save, train
from eagle3.train.metrics import read_metrics
from eagle3.train.trainer import setup
from tests.unit.test_train_helpers import SyntheticShape, load_run_config, synthetic_run

OVERRIDES = [
    "train.tokens_per_row=96",
    "train.grad_accum_steps=2",
    "train.num_epochs=3",
    "train.lr=1e-3",
    "train.eval_every_steps=0",
    "train.checkpoint_every_steps=0",
    "train.aux_noise=gaussian",
    "train.progress_every_s=0",
    "drafter.ttt_steps=2",
]


def _trainer(cfg):
    info = init_distributed("cpu")
    inputs = read_inputs(cfg, prepare_target(cfg))
    return setup(cfg, info, inputs, stage_key_for(cfg, inputs))


def _tensors(state) -> list[torch.Tensor]:
    """Every tensor of a nested state dict, in a stable order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in _tensors(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def _scalars(state):
    """The non-tensor leaves of a nested state dict (hyperparameters, step counts)."""
    if isinstance(state, dict):
        return {k: _scalars(v) for k, v in state.items() if not isinstance(v, torch.Tensor)}
    return state


def test_checkpoint_round_trip_restores_every_piece_of_state(tmp_path):
    """Weights, optimizer, scheduler, step, sampler position, tokens seen and RNG all come back equal."""
    cfg = load_run_config(synthetic_run(tmp_path, OVERRIDES))
    old = _trainer(cfg)
    run(old, stop_after_steps=2)
    random.seed(11)
    torch.manual_seed(12)
    save(old, None)
    want_draws = (random.random(), torch.rand(3))
    random.seed(99)
    torch.manual_seed(99)
    new = _trainer(cfg)  # seeds from the config, then resumes from the checkpoint
    assert (random.random(), *torch.rand(3).tolist()) == (want_draws[0], *want_draws[1].tolist())
    assert new.state == old.state and new.state.step == 2 and new.state.epoch_rows_done == 4
    for a, b in zip(old.model.state_dict().values(), new.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    old_opt, new_opt = old.optimizer.state_dict(), new.optimizer.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(_tensors(old_opt), _tensors(new_opt), strict=True))
    assert _scalars(old_opt["param_groups"]) == _scalars(new_opt["param_groups"])
    assert old.scheduler.state_dict() == new.scheduler.state_dict()
    next_old, next_new = next(micro_batch_windows(old)), next(micro_batch_windows(new))
    assert [r.noise_seed for r in next_old] == [r.noise_seed for r in next_new]
    assert all(torch.equal(a.batch.input_ids, b.batch.input_ids) for a, b in zip(next_old, next_new, strict=True))


def test_incomplete_checkpoints_are_ignored_and_pruned(tmp_path):
    """A temp dir or a step dir without checkpoint.json never counts as a checkpoint; prune removes temp dirs."""
    ckpt = tmp_path / "checkpoints"
    for name in ("step-3", "step-9", ".step-12.tmp-77"):
        (ckpt / name).mkdir(parents=True)
    (ckpt / "step-3" / "checkpoint.json").write_text("{}")
    (ckpt / ".step-12.tmp-77" / "checkpoint.json").write_text("{}")
    assert latest_checkpoint(ckpt) == ckpt / "step-3"
    prune(ckpt, keep=2)
    assert not (ckpt / ".step-12.tmp-77").exists() and (ckpt / "step-3").exists()


def test_prune_keeps_the_protected_step(tmp_path):
    """prune(keep=1, protect=2) removes every older step but the protected one (the best checkpoint)."""
    ckpt = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        (ckpt / f"step-{step}").mkdir(parents=True)
        (ckpt / f"step-{step}" / "checkpoint.json").write_text("{}")
    removed = prune(ckpt, keep=1, protect=2)
    assert sorted(p.name for p in removed) == ["step-1", "step-3"]
    assert [step for step, _ in list_checkpoints(ckpt)] == [2, 4]


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    """With keep_checkpoints=2 and a checkpoint every step, only the last two remain."""
    cfg = load_run_config(
        synthetic_run(
            tmp_path, [*OVERRIDES, "train.checkpoint_every_steps=1", "train.keep_checkpoints=2", "train.max_steps=4"]
        )
    )
    train(cfg)
    assert [step for step, _ in list_checkpoints(checkpoints_dir(cfg.run_dir))] == [3, 4]


def test_checkpoint_of_another_config_is_refused(tmp_path):
    """Resuming with another learning rate fails with a message instead of mixing two runs."""
    cfg = load_run_config(synthetic_run(tmp_path, OVERRIDES))
    train(cfg, stop_after_steps=1)
    changed = cfg.model_copy(update={"train": cfg.train.model_copy(update={"lr": 5e-4})})
    with pytest.raises(CheckpointMismatchError, match="another drafter/train config"):
        train(changed)


def test_topk_supervision_trains_and_resumes(tmp_path):
    """With top-K log-prob features (no final states) training runs, stops, resumes and finishes."""
    shape = SyntheticShape(topk=6)
    cfg = load_run_config(synthetic_run(tmp_path, [*OVERRIDES, "train.max_steps=4"], shape=shape))
    assert train(cfg, stop_after_steps=2).status == "stopped"
    result = train(cfg)
    losses = [r["loss"] for r in read_metrics(cfg.run_dir / "train" / "metrics.jsonl")]
    assert (result.status, result.step, len(losses)) == ("done", 4, 4) and all(0 < x < 100 for x in losses)
