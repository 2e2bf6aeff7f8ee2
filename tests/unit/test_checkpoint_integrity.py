"""Checkpoints are verified by content: checkpoint.json records the sha256 of every file as it is written, and a
checkpoint whose bytes changed since is never resumed from, exported or selected (a flipped bit names the file)."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from eagle3.train.checkpoint import CorruptCheckpointError, checkpoints_dir, list_checkpoints, read_info, step_dir
from eagle3.train.loop import train
from infra.storage import sha256_file
from tests.unit.test_train_helpers import load_run_config, synthetic_run

OVERRIDES = [
    "train.tokens_per_row=96",
    "train.lr=1e-3",
    "train.max_steps=4",
    "train.eval_every_steps=0",
    "train.checkpoint_every_steps=2",
    "train.keep_checkpoints=4",
    "train.progress_every_s=0",
    "drafter.ttt_steps=2",
]


def _flip_a_bit(path, mask: int = 0x40) -> None:
    """Flip a bit (default: the top exponent bit) of the last float of a file in place (same size, same inode)."""
    with open(path, "r+b") as fh:
        fh.seek(-1, 2)
        byte = fh.read(1)[0]
        fh.seek(-1, 2)
        fh.write(bytes([byte ^ mask]))


def _ckpt(cfg, step: int):
    return step_dir(checkpoints_dir(cfg.run_dir), step)


def _final_model(cfg) -> bytes:
    manifest = json.loads((cfg.run_dir / "train" / "train.manifest.json").read_text())
    return (cfg.run_dir / "train" / manifest["stats"]["final_checkpoint"] / "model.safetensors").read_bytes()


def test_checkpoints_record_the_sha256_of_every_file(tmp_path):
    """checkpoint.json holds the size and sha256 of each other file of the checkpoint, as written."""
    cfg = load_run_config(synthetic_run(tmp_path, OVERRIDES))
    train(cfg, stop_after_steps=1)
    path = _ckpt(cfg, 1)
    hashes = read_info(path)["sha256"]
    assert sorted(hashes) == ["config.json", "model.safetensors", "optimizer.pt", "trainer.pt"]
    assert all(hashes[name] == sha256_file(path / name) for name in hashes)


def test_a_flipped_bit_in_the_final_checkpoint_is_redone_not_reblessed(tmp_path):
    """A finished run whose final model.safetensors lost a bit: the rerun refuses it, resumes from the previous good
    checkpoint and ends with the weights of an untouched run (the damaged folder is kept aside, renamed)."""
    overrides = [*OVERRIDES, "train.max_steps=2", "train.checkpoint_every_steps=1"]
    reference = load_run_config(synthetic_run(tmp_path / "a", overrides))
    assert train(reference).status == "done"
    cfg = load_run_config(synthetic_run(tmp_path / "b", overrides))
    assert train(cfg).status == "done"
    _flip_a_bit(_ckpt(cfg, 2) / "model.safetensors")
    result = train(cfg)
    assert (result.status, result.step) == ("done", 2)
    assert _final_model(cfg) == _final_model(reference)
    assert [s for s, _ in list_checkpoints(checkpoints_dir(cfg.run_dir))] == [1, 2]
    assert (checkpoints_dir(cfg.run_dir) / "step-2.corrupt" / "model.safetensors").is_file()


def test_resume_fails_clearly_when_no_checkpoint_is_intact(tmp_path):
    """The only checkpoint is damaged: training stops with an error naming the file instead of resuming from it
    (or silently starting over)."""
    cfg = load_run_config(synthetic_run(tmp_path, OVERRIDES))
    train(cfg, stop_after_steps=1)
    damaged = _ckpt(cfg, 1) / "optimizer.pt"
    _flip_a_bit(damaged)
    with pytest.raises(CorruptCheckpointError, match=str(damaged)):
        train(cfg)
    assert (_ckpt(cfg, 1) / "optimizer.pt").is_file()  # nothing moved: the user decides


def test_a_damaged_best_checkpoint_is_refused_before_it_is_selected(tmp_path):
    """The best checkpoint (train.select=best) lost a bit while the run was stopped: the resumed run fails naming
    the file rather than writing a manifest that blesses it."""
    cfg = load_run_config(
        synthetic_run(tmp_path, [*OVERRIDES, "train.eval_every_steps=1", "train.checkpoint_every_steps=0"])
    )
    train(cfg, stop_after_steps=3)
    best = read_info(_ckpt(cfg, 3))["best_step"]
    assert best is not None and best != 3, "the test needs a best step other than the latest checkpoint"
    damaged = _ckpt(cfg, best) / "model.safetensors"
    _flip_a_bit(damaged)
    with pytest.raises(CorruptCheckpointError, match=str(damaged)):
        train(cfg)
    assert not (cfg.run_dir / "train" / "train.manifest.json").exists()


def test_export_refuses_a_damaged_checkpoint(tmp_path):
    """export.checkpoint naming a checkpoint whose weights changed on disk: refused, naming the file."""
    from eagle3.export.stage import run_export

    cfg = load_run_config(synthetic_run(tmp_path, OVERRIDES))
    assert train(cfg).status == "done"
    damaged = _ckpt(cfg, 2) / "model.safetensors"
    _flip_a_bit(damaged, mask=0x01)  # the weights stay finite: only the hash can tell
    cfg = cfg.model_copy(update={"export": cfg.export.model_copy(update={"checkpoint": "checkpoints/step-2"})})
    with pytest.raises(CorruptCheckpointError, match=str(damaged)):
        run_export(cfg)
    assert load_file(str(damaged))  # still there, untouched by the refusal
