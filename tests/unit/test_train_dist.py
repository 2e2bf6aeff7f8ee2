"""Data parallelism on CPU (gloo): real torchrun with 2 processes, 1- vs 2-process parity, FSDP2 vs DDP."""

from __future__ import annotations

import pytest

from eagle3.train.loop import train
from eagle3.train.metrics import read_metrics
from tests.unit.test_train_helpers import load_run_config, synthetic_run, torchrun_two

# Rows per optimizer step R = world x accum = 2 in every run below; lr_scaling=linear against a reference of 1
# row makes each of them train at 2 x lr (the documented rule), so their updates must coincide.
COMMON = [
    "train.tokens_per_row=96",
    "train.num_epochs=4",
    "train.lr=2e-3",
    "train.lr_scaling=linear",
    "train.reference_rows_per_step=1",
    "train.warmup_steps=1",
    "train.eval_every_steps=4",
    "train.checkpoint_every_steps=0",
    "train.progress_every_s=0",
    "drafter.ttt_steps=2",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same data trained by torchrun x2 (DDP and FSDP2, 1 row per rank and step) and by 1 process x 2 rows."""
    out = {}
    for parallel in ("ddp", "fsdp"):
        config = synthetic_run(tmp_path_factory.mktemp(parallel), COMMON)
        proc = torchrun_two(config, parallel)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out[parallel] = (load_run_config(config), proc.stdout)
    single = load_run_config(synthetic_run(tmp_path_factory.mktemp("single"), [*COMMON, "train.grad_accum_steps=2"]))
    train(single)
    out["single"] = (single, "")
    return out


def _curve(cfg, kind: str = "train") -> list[float]:
    return [r["loss"] for r in read_metrics(cfg.run_dir / "train" / "metrics.jsonl", kind)]


def test_torchrun_two_processes_reduce_the_val_loss(runs):
    """Under real torchrun with 2 processes the val loss falls at every evaluation."""
    cfg, stdout = runs["ddp"]
    evals = _curve(cfg, "eval")
    assert len(evals) >= 3 and all(later < earlier for earlier, later in zip(evals, evals[1:]))
    assert "world 2 (ddp)" in stdout and stdout.count("[rank 0] step ") == len(_curve(cfg))


def test_one_and_two_processes_give_the_same_loss_curve(runs):
    """1 process x 2 accumulation steps and 2 processes x 1 step: the same global batches, the same losses."""
    two, one = _curve(runs["ddp"][0]), _curve(runs["single"][0])
    assert len(two) == len(one) > 10
    assert two == pytest.approx(one, rel=1e-5)


def test_fsdp_gives_the_ddp_loss_curve(runs):
    """FSDP2 (fully_shard) and DDP train the same model on the same data: the same losses."""
    assert _curve(runs["fsdp"][0]) == pytest.approx(_curve(runs["ddp"][0]), rel=1e-5)
