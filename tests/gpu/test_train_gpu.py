"""The trainer on CUDA: flex attention + bf16 autocast learn, resume continues, FSDP2 under torchrun (nccl);
the fast unroll (compiled pieces, fused chunked loss, one block mask per row) equals the plain one."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from eagle3.drafter.functional import resolve_attn_impl
from eagle3.drafter.model import DrafterDims, Eagle3Drafter, init_weights, trainable_parameters
from eagle3.drafter.ttt import StepOptions, TTTBatch, TTTObjective
from eagle3.train.loop import train
from eagle3.train.metrics import read_metrics
from tests.unit.test_train_helpers import SyntheticShape, load_run_config, synthetic_run

pytestmark = pytest.mark.gpu

# head_dim 16 (flex kernels need >= 16); rows of 256 tokens (two 128-token flex blocks).
SHAPE = SyntheticShape(
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    vocab_size=160,
    draft_vocab_size=96,
    lengths=(200, 120, 90, 250, 60, 180, 140, 30, 220, 100, 75, 160),
)
OVERRIDES = [
    "train.device=cuda",
    "train.tokens_per_row=256",
    "train.num_epochs=8",
    "train.lr=3e-3",
    "train.warmup_steps=2",
    "train.eval_every_steps=6",
    "train.checkpoint_every_steps=0",
    "train.progress_every_s=0",
    "drafter.ttt_steps=3",
    "drafter.attn_impl=flex",
]


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
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        "-m",
        "eagle3.train",
        "--config",
        str(config),
    ]
    first = subprocess.run([*cmd, "--stop-after-steps", "2"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming from" in second.stdout and "(fsdp)" in second.stdout
    losses = _losses(load_run_config(config))
    assert len(losses) >= 4 and all(loss == loss for loss in losses)  # every step logged once, no NaN


# ------------------------------------------------------------------------------ fast unroll vs plain unroll

DIMS = DrafterDims(
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=None,
    vocab_size=512,
    draft_vocab_size=300,
    num_aux=3,
    target_hidden_size=128,
)
PLAIN = StepOptions()
FAST = StepOptions(compile_backend="inductor", loss_chunk_tokens=100, reuse_block_mask=True)  # 100 splits 512 unevenly


def _objective(options: StepOptions) -> TTTObjective:
    """Seeded drafter (fp32 master weights) with ttt 4 and flex attention on the GPU."""
    drafter = Eagle3Drafter(DIMS)
    init_weights(drafter, std=0.05, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(torch.randn(DIMS.vocab_size, DIMS.hidden_size, generator=g))
    used = torch.randperm(DIMS.vocab_size, generator=g)[: DIMS.draft_vocab_size].sort().values
    t2d = torch.zeros(DIMS.vocab_size, dtype=torch.bool)
    t2d[used] = True
    lm_head = torch.randn(DIMS.vocab_size, DIMS.hidden_size, generator=g) * 0.1
    objective = TTTObjective(
        drafter, t2d, used - torch.arange(len(used)), lm_head.bfloat16(), 4, attn_impl="flex", options=options
    )
    return objective.cuda()


def _batch() -> TTTBatch:
    """Two rows of 256 tokens, the first packing documents of 100 and 156."""
    g = torch.Generator().manual_seed(2)
    batch = TTTBatch(
        aux=torch.randn(2, 256, 3 * DIMS.hidden_size, generator=g).bfloat16(),
        input_ids=torch.randint(0, DIMS.vocab_size, (2, 256), generator=g),
        loss_mask=(torch.rand(2, 256, generator=g) < 0.8).to(torch.uint8),
        document_ids=torch.tensor([[0] * 100 + [1] * 156, [0] * 256]),
        final_hidden=torch.randn(2, 256, DIMS.hidden_size, generator=g).bfloat16() * 3,
    )
    return TTTBatch(**{k: v.cuda() for k, v in vars(batch).items() if v is not None})


def _unroll(options: StepOptions, grad: bool = True):
    objective, batch = _objective(options), _batch()
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.set_grad_enabled(grad):
        out = objective(batch)
    grads = torch.autograd.grad(out.loss, trainable_parameters(objective.drafter)) if grad else None
    return out, grads


@pytest.mark.parametrize(
    "options",
    [FAST, StepOptions(reuse_block_mask=True), StepOptions(loss_chunk_tokens=100)],
    ids=["compiled_fused_one_mask", "one_mask_eager", "fused_loss_eager"],
)
def test_fast_unroll_equals_the_plain_unroll_within_bf16_noise(options):
    """Same alignment counts, per-step losses within 2%, every gradient at cosine > 0.99 of the plain path's."""
    plain, plain_grads = _unroll(PLAIN)
    fast, fast_grads = _unroll(options)
    assert torch.equal(fast.num_supervised, plain.num_supervised) and int(plain.num_supervised.min()) > 0
    assert torch.equal(fast.num_predicted, plain.num_predicted)
    torch.testing.assert_close(fast.loss_sum, plain.loss_sum, rtol=2e-2, atol=0)
    assert (fast.num_correct - plain.num_correct).abs().max() <= max(2, int(0.02 * plain.num_predicted.max()))
    for p, a, b in zip(trainable_parameters(_objective(PLAIN).drafter), fast_grads, plain_grads):
        cosine = torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0)
        assert cosine > 0.99 and a.norm() == pytest.approx(float(b.norm()), rel=5e-2), p.shape


def test_fast_unroll_without_grad_matches_with_grad():
    """Evaluation (no_grad: the compiled inference variants) gives the training forward's losses and counts."""
    train_out, _ = _unroll(FAST)
    eval_out, _ = _unroll(FAST, grad=False)
    torch.testing.assert_close(eval_out.loss_sum, train_out.loss_sum.detach(), rtol=1e-2, atol=0)
    assert torch.equal(eval_out.num_supervised, train_out.num_supervised)
