"""The trainer on CUDA: flex attention + bf16 autocast learn, resume continues, FSDP2 under torchrun (nccl)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from eagle3.model import resolve_attn_impl
from eagle3.train.loop import train
from eagle3.train.metrics import read_metrics
from tests.unit.test_train_helpers import SyntheticShape, load_run_config, synthetic_run

pytestmark = pytest.mark.gpu

# head_dim 16 (flex kernels need >= 16); rows of 256 tokens (two 128-token flex blocks).
SHAPE = SyntheticShape(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=160,
                       draft_vocab_size=96, lengths=(200, 120, 90, 250, 60, 180, 140, 30, 220, 100, 75, 160))
OVERRIDES = ["train.device=cuda", "train.max_tokens_per_batch=256", "train.num_epochs=8", "train.lr=3e-3",
             "train.warmup_steps=2", "train.eval_every_steps=6", "train.checkpoint_every_steps=0",
             "train.progress_every_s=0", "drafter.ttt_steps=3", "drafter.attn_impl=flex"]


def _losses(cfg, kind: str = "train") -> list[float]:
    return [r["loss"] for r in read_metrics(cfg.run_dir / "train" / "metrics.jsonl", kind)]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """A complete CUDA run (flex attention, bf16 autocast)."""
    cfg = load_run_config(synthetic_run(tmp_path_factory.mktemp("gpu"), OVERRIDES, shape=SHAPE))
    return cfg, train(cfg)


def test_cuda_flex_bf16_run_learns_and_reports_mfu(full_run):
    """On CUDA the flex path is used, the val loss falls at every evaluation, and MFU is logged."""
    cfg, result = full_run
    assert result.status == "done" and resolve_attn_impl("auto", torch.device("cuda")) == "flex"
    evals = _losses(cfg, "eval")
    assert len(evals) >= 3 and all(b < a for a, b in zip(evals, evals[1:]))
    records = read_metrics(cfg.run_dir / "train" / "metrics.jsonl")
    assert all(r["mfu"] is not None and r["mfu"] > 0 for r in records)


def test_cuda_resume_continues_the_same_run(full_run, tmp_path):
    """Stop after 3 steps and resume on CUDA: the same step count, losses and weights within bf16 noise."""
    full_cfg, full = full_run
    cfg = load_run_config(synthetic_run(tmp_path, OVERRIDES, shape=SHAPE))
    assert train(cfg, stop_after_steps=3).step == 3
    resumed = train(cfg)
    assert resumed.step == full.step
    assert _losses(cfg) == pytest.approx(_losses(full_cfg), rel=2e-3)
    a, b = load_file(resumed.checkpoint / "model.safetensors"), load_file(full.checkpoint / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], rtol=1e-2, atol=1e-3) for k in b)


def test_fsdp_under_torchrun_on_cuda_checkpoints_and_resumes(tmp_path):
    """torchrun (nccl) with FSDP2: a stopped run leaves a checkpoint, and the rerun finishes from it."""
    config = synthetic_run(tmp_path, [*OVERRIDES, "train.parallel=fsdp", "train.num_epochs=2"], shape=SHAPE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "eagle3.train",
           "--config", str(config)]
    first = subprocess.run([*cmd, "--stop-after-steps", "2"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming from" in second.stdout and "(fsdp)" in second.stdout
    losses = _losses(load_run_config(config))
    assert len(losses) >= 4 and all(loss == loss for loss in losses)  # every step logged once, no NaN
