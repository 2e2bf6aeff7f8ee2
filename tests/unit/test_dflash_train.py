"""The train stage with drafter.family=dflash on the tiny preset's real run (its EAGLE-3 features): the loss falls,
a stopped and resumed run equals an uninterrupted one, the checkpoint holds the DFlash export's names, the drafter
may read a subset of the captured layers, and online features train what offline shards train."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from eagle3.train.loop import train
from eagle3.train.metrics import read_metrics
from tests.unit.test_train_helpers import assert_resume_matches, load_run_config, real_tiny_run, step_losses

DFLASH = ["drafter.family=dflash", "drafter.dflash.block_size=4", "drafter.dflash.num_blocks=16"]
# ~7 rows of 1024 tokens per epoch, 2 rows per step: 6 steps cross from epoch 0 into epoch 1.
OVERRIDES = [
    *DFLASH,
    "train.tokens_per_row=1024",
    "train.grad_accum_steps=2",
    "train.num_epochs=2",
    "train.max_steps=6",
    "train.lr=1e-2",
    "train.warmup_steps=2",
    "train.eval_every_steps=3",
    "train.checkpoint_every_steps=0",
    "train.aux_noise=uniform",
    "train.progress_every_s=0",
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The 6-step DFlash run without interruption."""
    cfg = load_run_config(real_tiny_run(tmp_path_factory.mktemp("dflash-full") / "runs", OVERRIDES))
    return cfg, train(cfg)


def test_loss_falls_and_validation_is_recorded(uninterrupted):
    """The weighted block loss falls below the first step's (by > 0.1 nats), validation records accept_len_est and
    the unigram baseline at steps 3 and 6, and the manifest names the best checkpoint."""
    cfg, result = uninterrupted
    losses = [loss for _, loss in step_losses(cfg)]
    evals = read_metrics(cfg.run_dir / "train" / "metrics.jsonl", "eval")
    assert result.status == "done" and len(losses) == 6
    assert evals[-1]["loss"] < losses[0] - 0.1, (losses, [e["loss"] for e in evals])
    assert [e["step"] for e in evals] == [3, 6]
    assert all(e["accept_len_est"] >= 1 and {"acc_0", "acc_2", "full_acc_2"} <= e.keys() for e in evals)
    assert all(0 <= e["unigram_acc_0"] <= 1 for e in evals)
    stats = json.loads((cfg.run_dir / "train" / "train.manifest.json").read_text())["stats"]
    assert stats["best_step"] in (3, 6) and stats["best_checkpoint"] == f"checkpoints/step-{stats['best_step']}"


def test_resume_matches_uninterrupted_run(uninterrupted, tmp_path):
    """3 steps, stop, resume for 3 more: the same per-step losses (1e-6) and the same final weights (the anchors
    of each row are drawn from the row's own seed, so the resumed run scores the same blocks)."""
    full_cfg, full = uninterrupted
    assert_resume_matches(full_cfg, full, tmp_path / "runs", OVERRIDES)


def test_checkpoint_holds_the_dflash_export_names(uninterrupted):
    """The checkpoint's weights are exactly the DFlash layout's tensors (no target embeddings or lm_head)."""
    from eagle3.export.dflash import dflash_tensor_specs
    from eagle3.target.load import prepare_target
    from eagle3.train.dflash import dflash_setup

    cfg, result = uninterrupted
    weights = load_file(result.checkpoint / "model.safetensors")
    setup = dflash_setup(cfg, prepare_target(cfg), [1, 3, 4])
    specs = dflash_tensor_specs(setup.dims, torch.float32)
    assert {k: (tuple(v.shape), v.dtype) for k, v in weights.items()} == specs
    assert setup.target_layer_ids == [1, 3, 4] and setup.feature_index == [0, 1, 2]


def test_a_subset_of_the_captured_layers_trains(tmp_path):
    """target_layer_ids [1, 4] of the captured [1, 3, 4]: fc reads 2 layers; a layer not captured is refused by name."""
    from eagle3.target.load import prepare_target
    from eagle3.train.dflash import dflash_setup

    overrides = [*OVERRIDES, "train.max_steps=2", "drafter.dflash.target_layer_ids=[1,4]"]
    cfg = load_run_config(real_tiny_run(tmp_path / "runs", overrides))
    result = train(cfg)
    assert result.status == "done"
    assert load_file(result.checkpoint / "model.safetensors")["fc.weight"].shape == (64, 128)
    assert dflash_setup(cfg, prepare_target(cfg), [1, 3, 4]).feature_index == [0, 2]
    bad = cfg.model_copy(
        update={
            "drafter": cfg.drafter.model_copy(
                update={"dflash": cfg.drafter.dflash.model_copy(update={"target_layer_ids": [2, 4]})}
            )
        }
    )
    with pytest.raises(ValueError, match=r"target_layer_ids \[2, 4\]: layers \[2\] are not among the captured"):
        dflash_setup(bad, prepare_target(cfg), [1, 3, 4])


def test_online_features_train_what_offline_shards_train(uninterrupted, tmp_path):
    """train.features=online (the target runs in each step, on the CPU bitwise the captured states) gives the
    offline run's per-step losses."""
    full_cfg, _ = uninterrupted
    cfg = load_run_config(real_tiny_run(tmp_path / "runs", [*OVERRIDES, "train.features=online"]))
    assert train(cfg).status == "done"
    got, want = step_losses(cfg), step_losses(full_cfg)
    assert len(got) == len(want) == 6
    assert all(abs(a - b) <= 1e-5 for (_, a), (_, b) in zip(got, want)), (got, want)
