"""Acceptance-targeted losses (train.loss): hand values, gradients, the fused path, kl parity, a CPU training run."""

from __future__ import annotations

import json
import math
import typing

import pytest
import torch

from eagle3.drafter.acceptance import (
    EPS,
    LOSS_KINDS,
    TokenLoss,
    acceptance_chunk_grad,
    acceptance_kernels,
    step_token_loss,
    token_loss,
)
from eagle3.drafter.alignment import supervision_from_topk
from eagle3.drafter.soft_ce import ChunkedSoftCE, pad_probs
from eagle3.drafter.ttt import StepOptions
from tests.unit.test_ttt import GOLDEN_LOSSES, VD, random_inputs, run_optimized, tiny_model

ACCEPTANCE = [TokenLoss("tv"), TokenLoss("kl+tv", tv_weight=0.25), TokenLoss("lk_alpha"), TokenLoss("lk_lambda")]
"""Every loss other than the soft cross-entropy (kl+tv at a weight other than its default)."""

# The hand example: target probs p and draft probs q over a draft vocab of 3.
P, Q = [0.3, 0.5, 0.2], [0.2, 0.3, 0.5]
CE = -(0.3 * math.log(0.2) + 0.5 * math.log(0.3) + 0.2 * math.log(0.5))
ALPHA = 0.2 + 0.3 + 0.2  # sum_v min(p_v, q_v) = 1 - 0.5 * (0.1 + 0.2 + 0.3)
LAMBDA = math.exp(-3.0 * ALPHA)
HAND = {
    "kl": CE,
    "tv": 1 - ALPHA,
    "kl+tv": 0.75 * CE + 0.25 * (1 - ALPHA),
    "lk_alpha": -math.log(ALPHA + EPS),
    "lk_lambda": LAMBDA * CE + (1 - LAMBDA) * (1 - ALPHA),
}


def hand_supervision() -> torch.Tensor:
    """[1, 3, 3] draft-vocab probs rebuilt from full-vocab top-K log-probs: P at position 1, other rows elsewhere.

    Target vocab 5, draft vocab {1, 3, 4} (draft ids 0, 1, 2). Position 1's top 4: id 3 0.4, id 0 0.2 (outside the
    draft vocab: dropped), id 1 0.24, id 4 0.16; renormalised over 0.8 that is P = [0.3, 0.5, 0.2] in draft order.
    """
    t2d = torch.tensor([False, True, False, True, True])
    ids = torch.tensor([[[1, 3, 4, 0], [3, 0, 1, 4], [4, 1, 3, 0]]])
    logprobs = torch.log(torch.tensor([[[0.7, 0.1, 0.1, 0.1], [0.4, 0.2, 0.24, 0.16], [0.5, 0.2, 0.2, 0.1]]]))
    sup = supervision_from_topk(ids, logprobs, t2d)
    torch.testing.assert_close(sup.probs[0, 1], torch.tensor(P))
    return sup.probs.double()


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_hand_values_through_the_draft_vocab_map_and_the_mask(kind):
    """p from top-K ids through t2d, q = Q at the one supervised position: plain and fused give the hand value;
    the masked position and the one past the row add nothing."""
    loss = TokenLoss(kind, tv_weight=0.25)
    probs = hand_supervision()  # [1, 3, Vd]
    logits = torch.log(torch.tensor([[Q, [0.6, 0.2, 0.2], [0.1, 0.1, 0.8]]], dtype=torch.float64))  # [1, 3, Vd]
    mask = torch.tensor([[True, False, False]])  # logits[0] vs probs[1] supervised; logits[1] masked; logits[2] past
    plain = torch.where(mask, step_token_loss(logits, probs, 1, loss), 0).sum()
    fused, _ = ChunkedSoftCE.apply(logits, pad_probs(probs, 1), mask, 1, 2, acceptance_kernels(loss))
    assert plain.item() == pytest.approx(HAND[kind], rel=1e-6)  # p went through fp32 (supervision_from_topk)
    assert fused.item() == pytest.approx(plain.item(), rel=1e-12)
    assert step_token_loss(logits, probs, 1, loss)[0, 2] == 0  # t + shift past the row


def test_tv_is_half_the_l1_distance_and_one_minus_acceptance():
    """On random p, q the tv loss equals 0.5 * sum |p - q| (the definition), so 1 - it is sum min(p, q)."""
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(6, VD, generator=g, dtype=torch.float64), -1)
    log_q = torch.log_softmax(torch.randn(6, VD, generator=g, dtype=torch.float64), -1)
    tv = token_loss(log_q, p, TokenLoss("tv"))
    torch.testing.assert_close(tv, 0.5 * (p - log_q.exp()).abs().sum(-1), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss", ACCEPTANCE, ids=lambda loss: loss.kind)
def test_one_sgd_step_raises_the_acceptance(loss):
    """Free draft logits against a fixed target: one gradient step on the loss raises sum_v min(p, q)."""
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(2 * torch.randn(4, VD, generator=g, dtype=torch.float64), -1)
    x = torch.randn(4, VD, generator=g, dtype=torch.float64, requires_grad=True)

    def acceptance(logits: torch.Tensor) -> torch.Tensor:
        return torch.minimum(p, torch.softmax(logits, -1)).sum(-1)

    token_loss(torch.log_softmax(x, -1), p, loss).sum().backward()
    with torch.no_grad():
        after = acceptance(x - 0.5 * x.grad)
    assert (after > acceptance(x.detach())).all(), (acceptance(x.detach()), after)


@pytest.mark.parametrize("loss", ACCEPTANCE, ids=lambda loss: loss.kind)
@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_fused_kernels_equal_autograd_of_the_plain_loss(loss, chunk):
    """Sum, argmax and logits gradient of the chunked loss equal autograd over step_token_loss, zeros in p included."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 12, VD, generator=g, dtype=torch.float64, requires_grad=True)
    probs = torch.softmax(torch.randn(2, 12, VD, generator=g, dtype=torch.float64), -1)
    probs[0, 3:6, : VD // 2] = 0  # a truncated (top-K) target: no mass on half the draft vocab
    probs = probs / probs.sum(-1, keepdim=True)
    mask = torch.rand(2, 12, generator=g) < 0.7
    mask[:, -2:] = False  # read past their row (shift 2)
    plain = torch.where(mask, step_token_loss(logits, probs, 2, loss), 0).sum()
    fused, top = ChunkedSoftCE.apply(logits, pad_probs(probs, 3), mask, 2, chunk, acceptance_kernels(loss))
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-14)
    assert torch.equal(top, logits.argmax(-1))
    (want,) = torch.autograd.grad(2.5 * plain, logits)
    (got,) = torch.autograd.grad(2.5 * fused, logits)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
    assert got[~mask].abs().max() == 0 and got[mask].abs().max() > 0


@pytest.mark.parametrize("loss", ACCEPTANCE, ids=lambda loss: loss.kind)
def test_the_gradient_formula_splits_ties_as_autograd_does(loss):
    """Where q_v = p_v exactly, min(p, q) follows q by half (torch.minimum's rule); the kernel's formula agrees."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, VD, generator=g, dtype=torch.float64, requires_grad=True)
    lse = torch.logsumexp(x.detach(), -1)
    p = torch.softmax(torch.randn(3, VD, generator=g, dtype=torch.float64), -1)
    p[1] = torch.exp(x.detach()[1] - lse[1])  # row 1: p = q bit for bit, a tie at every id
    p[2, :4] = torch.exp(x.detach()[2, :4] - lse[2])  # row 2: ties at four ids only (p no longer sums to 1)
    (want,) = torch.autograd.grad(token_loss(x - torch.logsumexp(x, -1, keepdim=True), p, loss).sum(), x)
    got = acceptance_chunk_grad(x.detach(), p, torch.ones(3, dtype=torch.bool), lse, torch.tensor(1.0), loss)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("options", [StepOptions(), StepOptions(loss_chunk_tokens=7)], ids=["plain", "fused"])
def test_kl_is_the_soft_cross_entropy_bit_for_bit(options):
    """train.loss=kl is the objective as it was before the option: the default's bits (loss sums and every
    gradient) and the golden losses recorded before it (test_ttt)."""
    model, x = tiny_model(seed=11), random_inputs(2, 16, seed=12)
    docs = torch.tensor([[0] * 10 + [1] * 6, [0] * 16])
    default = run_optimized(model, x, docs, options=options)
    kl = run_optimized(model, x, docs, options=options, loss=TokenLoss("kl"))
    assert torch.equal(kl.loss_sum, default.loss_sum) and torch.equal(kl.loss, default.loss)
    params = [p for p in model.parameters() if p.requires_grad]
    for a, b in zip(torch.autograd.grad(kl.loss, params, retain_graph=True), torch.autograd.grad(default.loss, params)):
        assert torch.equal(a, b)
    m = kl.metrics()
    assert [m["loss_0"], m["loss_1"], m["loss_2"], m["loss"]] == pytest.approx(GOLDEN_LOSSES, rel=1e-9)


@pytest.mark.parametrize("loss", ACCEPTANCE, ids=lambda loss: loss.kind)
def test_the_whole_unroll_scores_by_the_loss_on_both_paths(loss):
    """Through the packed TTT unroll, the fused path equals the plain one (sums, counts, gradients) and the loss
    is not the soft CE's."""
    model, x = tiny_model(), random_inputs(2, 16, seed=17)
    docs = torch.tensor([[0] * 10 + [1] * 6, [0] * 16])
    plain = run_optimized(model, x, docs, loss=loss)
    fused = run_optimized(model, x, docs, options=StepOptions(loss_chunk_tokens=7), loss=loss)
    torch.testing.assert_close(fused.loss_sum, plain.loss_sum, rtol=1e-12, atol=1e-14)
    assert torch.equal(fused.num_correct, plain.num_correct)
    params = [p for p in model.parameters() if p.requires_grad]
    fused_grads = torch.autograd.grad(fused.loss, params, retain_graph=True)
    for a, b in zip(fused_grads, torch.autograd.grad(plain.loss, params)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert not torch.allclose(plain.loss_sum, run_optimized(model, x, docs).loss_sum.detach())


def test_compiled_kernels_trace_without_graph_breaks():
    """acceptance_kernels under torch.compile (aot_eager on CPU) trace whole and match eager, for every loss."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model, x = tiny_model(), random_inputs(2, 12, seed=18)
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    for loss in ACCEPTANCE:
        eager = run_optimized(model, x, docs, options=StepOptions(loss_chunk_tokens=5), loss=loss)
        compiled = run_optimized(model, x, docs, options=StepOptions("aot_eager", loss_chunk_tokens=5), loss=loss)
        torch.testing.assert_close(compiled.loss_sum, eager.loss_sum, rtol=1e-12, atol=1e-14)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_config_lists_the_losses_and_keys_them_only_once_set():
    """train.loss offers exactly the module's losses; the three fields enter the train key only off their defaults,
    so keys of runs trained before them stay valid."""
    from eagle3.config import TrainConfig
    from eagle3.config_base import key_fields
    from eagle3.train.step import token_loss_for

    assert typing.get_args(TrainConfig.model_fields["loss"].annotation) == LOSS_KINDS
    base = key_fields(TrainConfig())
    assert not {"loss", "loss_tv_weight", "loss_lk_eta"} & base.keys()
    assert key_fields(TrainConfig(loss="lk_lambda")) == {**base, "loss": "lk_lambda"}
    assert token_loss_for(TrainConfig()) == TokenLoss("kl")
    assert token_loss_for(TrainConfig(loss="kl+tv", loss_tv_weight=0.2)) == TokenLoss("kl+tv", 0.2, 3.0)


TRAIN_OVERRIDES = [
    "train.tokens_per_row=96",
    "train.lr=1e-3",
    "train.max_steps=3",
    "train.warmup_steps=0",
    "train.eval_every_steps=3",
    "train.checkpoint_every_steps=0",
    "train.progress_every_s=0",
    "train.device=cpu",
    "drafter.ttt_steps=2",
]


def _trained_losses(tmp_path, loss: str) -> list[dict]:
    from eagle3.train.loop import train
    from eagle3.train.metrics import read_metrics
    from tests.unit.test_train_helpers import load_run_config, synthetic_run

    cfg = load_run_config(synthetic_run(tmp_path / loss / "runs", [*TRAIN_OVERRIDES, f"train.loss={loss}"]))
    assert cfg.train.loss == loss and train(cfg).status == "done"
    manifest = json.loads((cfg.run_dir / "train" / "train.manifest.json").read_text())
    assert manifest["stats"]["final_checkpoint"] == "checkpoints/step-3"
    return read_metrics(cfg.run_dir / "train" / "metrics.jsonl")


def test_a_tiny_cpu_training_run_trains_with_an_acceptance_loss(tmp_path):
    """The synthetic run trains 3 steps with train.loss=tv and with lk_lambda: every step's loss is finite; tv's
    per-step losses are 1 - acceptance, inside [0, 1], where the soft CE of the same run starts above 1."""
    tv, lk, kl = (_trained_losses(tmp_path, name) for name in ("tv", "lk_lambda", "kl"))
    assert len(tv) == len(lk) == len(kl) == 3
    assert all(0 <= r[f"loss_{k}"] <= 1 for r in tv for k in range(2))
    assert all(math.isfinite(r["loss"]) for r in lk) and kl[0]["loss_0"] > 1
    assert lk[0]["loss"] != kl[0]["loss"]


def test_dflash_refuses_an_acceptance_loss(tmp_path):
    """drafter.family=dflash scores tokens by its own CE (no target distribution): another train.loss is an error
    naming the field, before any target is read."""
    from eagle3.config import load_config
    from eagle3.train.dflash import dflash_setup

    cfg = load_config("tiny", ["drafter.family=dflash", "train.loss=lk_lambda"])
    with pytest.raises(ValueError, match="train.loss=lk_lambda"):
        dflash_setup(cfg, tmp_path / "no-target", [1, 2, 3])
