"""DFlash training across processes on CPU (gloo): real torchrun with 2 processes equals 1 process with the same
global batch (losses and final weights), under DDP and FSDP2, on the tiny preset's run."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from eagle3.train.checkpoint import checkpoints_dir, step_dir
from eagle3.train.loop import train
from eagle3.train.metrics import read_metrics
from tests.unit.test_train_helpers import load_run_config, real_tiny_run, torchrun_two

# Rows per optimizer step R = world x accum = 2 in every run below, so every run trains at the same lr on the same
# rows; each row's anchors come from the row's own seed, so every run scores the same blocks.
COMMON = [
    "drafter.family=dflash",
    "drafter.dflash.block_size=4",
    "drafter.dflash.num_blocks=16",
    "train.tokens_per_row=1024",
    "train.num_epochs=2",
    "train.max_steps=6",
    "train.lr=1e-2",
    "train.warmup_steps=2",
    "train.eval_every_steps=3",
    "train.checkpoint_every_steps=0",
    "train.progress_every_s=0",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same rows trained by torchrun x2 (DDP and FSDP2, 1 row per rank and step) and by 1 process x 2 rows."""
    out = {}
    for parallel in ("ddp", "fsdp"):
        config = real_tiny_run(tmp_path_factory.mktemp(parallel) / "runs", COMMON)
        proc = torchrun_two(config, parallel)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out[parallel] = (load_run_config(config), proc.stdout)
    single = load_run_config(
        real_tiny_run(tmp_path_factory.mktemp("single") / "runs", [*COMMON, "train.grad_accum_steps=2"])
    )
    assert train(single).status == "done"
    out["single"] = (single, "")
    return out


def _curve(cfg, kind: str = "train") -> list[float]:
    return [r["loss"] for r in read_metrics(cfg.run_dir / "train" / "metrics.jsonl", kind)]


def _final_weights(cfg) -> dict[str, torch.Tensor]:
    """The weights of the run's step-6 checkpoint (its last)."""
    return load_file(step_dir(checkpoints_dir(cfg.run_dir), 6) / "model.safetensors")


def test_two_processes_train_the_dflash_drafter(runs):
    """Under real torchrun with 2 DDP processes the DFlash run logs every step on rank 0 and its loss falls."""
    cfg, stdout = runs["ddp"]
    losses = _curve(cfg)
    assert "world 2 (ddp)" in stdout and stdout.count("[rank 0] step ") == len(losses) == 6
    assert _curve(cfg, "eval")[-1] < losses[0] - 0.1, (losses, _curve(cfg, "eval"))


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_equal_one_process_with_the_same_global_batch(runs, parallel):
    """1 process x 2 accumulation steps and 2 processes x 1 step: the same per-step and val losses (1e-5) and the
    same final weights (1e-5 relative to each tensor's scale)."""
    two, one = runs[parallel][0], runs["single"][0]
    assert _curve(two) == pytest.approx(_curve(one), rel=1e-5) and len(_curve(one)) == 6
    assert _curve(two, "eval") == pytest.approx(_curve(one, "eval"), rel=1e-5)
    got, want = _final_weights(two), _final_weights(one)
    assert got.keys() == want.keys() and "fc.weight" in want
    for name, tensor in want.items():
        scale = float(tensor.abs().max())
        assert torch.allclose(got[name], tensor, rtol=0, atol=1e-5 * scale), name
